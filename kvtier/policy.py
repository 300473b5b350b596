"""The `KVCachePolicy` resource: pydantic models for its spec and status.

One model, one source. `kvtier crd` generates the CustomResourceDefinition's schema
from these classes, the operator parses every object it reads with them, and the
cross-field rules are declared once (`CelRule`: a CEL expression for the apiserver
beside the same predicate in Python), so a policy the apiserver accepts is a policy
the operator can parse, and a mistake is named with the same message in both places.

Field names are snake_case in Python and camelCase in JSON (Kubernetes style);
both spellings are accepted on input.
"""
from __future__ import annotations

import re
from datetime import datetime
from typing import Any, Literal

from pydantic import ConfigDict, Field

from kvtier import names, presets
from kvtier.presets import ModelShape
from kvtier.camel_model import CamelModel, CelRule
from kvtier.admission import DEFAULT_MIN_SIGHTINGS
from kvtier.admission import THRASH_RATIO as DEFAULT_THRASH_RATIO
from kvtier.affinity import DEFAULT_BALANCE_FACTOR, DEFAULT_HOMES, DEFAULT_HYSTERESIS, DEFAULT_SPILL_OCCUPANCY
from kvtier.breakeven import KV_DTYPE_BYTES
from kvtier.dtypes import DEFAULT_KV_DTYPE, KvDtype, KvDtypeName
from kvtier.identity import DEFAULT_ATTN_IMPL_ID, DEFAULT_ROPE_CONFIG_HASH, ModelIdentity
from kvtier.keys import DEFAULT_BLOCK_SIZE

GROUP = names.GROUP
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "KVCachePolicy"
PLURAL = "kvcachepolicies"
SINGULAR = "kvcachepolicy"
SHORT_NAMES = ("kvcp",)

# Block size, admission and affinity defaults are defined by the modules that own them
# (keys, admission, affinity) and imported above.
# Warm-up per moved tenant: a few thousand blocks of its hottest prefixes (at 320 KiB
# per token a 2,000-token prefix is 625 MiB, so 1 GiB covers a 70B tenant's top prefix).
DEFAULT_WARM_MAX_BYTES = "1Gi"
# A new epoch waits at most this long for warm-ups: membership changes must not stall.
DEFAULT_WARM_TIMEOUT = "30s"
# Warm-before-ready (spec.rollout.warmup): per new-version pod, prefill at most this many
# prompt tokens of its tenants' hottest prefixes through its own engine ...
DEFAULT_ROLLOUT_WARM_TOKENS = 65536
# ... within this deadline, then its readiness gate is released warm or not: a rollout
# step never waits on a warm-up for longer.
DEFAULT_ROLLOUT_WARM_TIMEOUT = "2m"
# Bounds: past these a budget is a typo (a pod prefilling 10M tokens before serving is
# an outage, not a warm-up), refused at apply.
MAX_ROLLOUT_WARM_TOKENS = 10_000_000
MAX_ROLLOUT_WARM_TIMEOUT_S = 3600
# The engine container's OpenAI-compatible HTTP port (vLLM's default).
DEFAULT_ENGINE_PORT = 8000
# Default rollout: one canary pod, then 10%, 50%, 100%: each step doubles or more the
# pods that start cold, and the canary shows a bad version on one pod first.
DEFAULT_CANARY_PODS = 1
DEFAULT_ROLLOUT_STEPS = (10, 50, 100)
# New-version pods must recover to this fraction of the old baseline hit rate ...
DEFAULT_RECOVERY_THRESHOLD = 0.8
# ... within this window (long enough for a cold pod to re-earn its hot prefixes) ...
DEFAULT_RECOVERY_WINDOW = "30m"
# ... judged on at least this many lookups, so a quiet canary is not failed on noise.
DEFAULT_RECOVERY_MIN_LOOKUPS = 1000
# Analysis (prometheus and alarm sources), Argo Rollouts' AnalysisTemplate semantics:
# a measurement every interval (a scrape or two apart at the usual 15-30 s scrape) ...
DEFAULT_ANALYSIS_INTERVAL = "30s"
# ... a step passes after this many successful measurements ...
DEFAULT_ANALYSIS_COUNT = 3
# ... and fails after more than this many failed ones (Argo's default: the first fails) ...
DEFAULT_ANALYSIS_FAILURE_LIMIT = 0
# ... while no data / too few lookups beyond this many pauses the rollout instead ...
DEFAULT_ANALYSIS_INCONCLUSIVE_LIMIT = 3
# ... as does an unreachable Prometheus beyond this many errors in a row (Argo's default).
DEFAULT_ANALYSIS_CONSECUTIVE_ERROR_LIMIT = 4
# The alarm source's alert by default: the chart's hit-rate alert (charts/kvtier).
DEFAULT_ALARM_ALERT = "KVTierHitRateDrop"
# The hit rate of one weights version of one policy, as the chart's recording rules and
# the sidecars' metrics name it: prompt tokens the engines loaded from kvtier over those
# they looked up (never what the lookups offered); `{{minLookups}}` keeps a quiet version out (no data).
DEFAULT_HIT_RATE_QUERY = (
    'sum(rate(kvtier_engine_loaded_tokens_total{namespace="{{namespace}}", policy="{{policy}}", version="{{version}}"}'
    '[{{window}}]))'
    ' / sum(rate(kvtier_engine_prompt_tokens_total{namespace="{{namespace}}", policy="{{policy}}", version="{{version}}"}'
    '[{{window}}]))'
    ' and sum(increase(kvtier_lookups_total{namespace="{{namespace}}", policy="{{policy}}", version="{{version}}"}'
    '[{{window}}])) >= {{minLookups}}'
)
# Media bandwidths, GB/s (docs/ARCHITECTURE.md "The numbers"): DRAM over PCIe5 x16,
# RDMA/200GbE, local NVMe.
DEFAULT_DRAM_GBPS = 64.0
DEFAULT_RDMA_GBPS = 25.0
DEFAULT_NVME_GBPS = 7.0
# Where a node's local NVMe is mounted, by convention (a hostPath on the sidecar).
DEFAULT_NVME_PATH = "/var/lib/kvtier/nvme"

# Presets are the break-even calculator's (kvtier.presets): the CRD's enums follow them.
ModelPreset = Literal[tuple(presets.MODELS)]  # type: ignore[valid-type]
GpuPreset = Literal[tuple(presets.GPUS)]  # type: ignore[valid-type]


# Bounds that keep CEL cost estimates finite and objects small.
_MAX_NAME = 253
_MAX_STEPS = 10
_MAX_SHARED_PREFIXES = 64
_MAX_PREFIX_TOKENS = 8192
# All shared prefixes together: 16,384 token ids render to at most ~256 KiB of sidecar
# config (about 15 bytes per id in YAML), a quarter of a ConfigMap's 1 MiB, and stay
# under kubectl's 256 KiB last-applied annotation too (about 11 bytes per id in JSON).
MAX_SHARED_PREFIX_TOKENS_TOTAL = 16384
_MAX_CONDITIONS = 16
# status.rollout.history entries kept (the operator keeps the newest).
MAX_HISTORY = 32
_MAX_UNINJECTED_NAMED = 20

WEIGHTS_DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$"
DURATION_PATTERN = r"^([0-9]+h)?([0-9]+m)?([0-9]+s)?$"
REDIS_URL_PATTERN = r"^(redis|rediss|unix)://.+$"
LABEL_KEY_PATTERN = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"


def _section(cls: type["CamelModel"]) -> Any:
    """An optional sub-object whose default is its fully defaulted form (the apiserver
    checks a default against the CEL rules as written, without defaulting inside it)."""
    return Field(default_factory=cls, json_schema_extra=lambda schema: schema.update(default=cls().k8s_json()))


def _name(**kw: Any) -> Any:
    return Field(min_length=1, max_length=_MAX_NAME, **kw)


# --- selector ------------------------------------------------------------------------


class LabelSelectorRequirement(CamelModel):
    """One `matchExpressions` term of a Kubernetes label selector."""

    key: str = _name(pattern=LABEL_KEY_PATTERN)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = Field(default_factory=list, max_length=64)

    CEL_RULES = (
        CelRule(
            "(self.operator in ['In', 'NotIn']) == (has(self.values) && size(self.values) > 0)",
            "matchExpressions: operators In and NotIn need values; Exists and DoesNotExist take none",
            lambda s: (s.operator in ("In", "NotIn")) == bool(s.values),
        ),
    )

    def matches(self, labels: dict[str, str]) -> bool:
        present = self.key in labels
        if self.operator == "Exists":
            return present
        if self.operator == "DoesNotExist":
            return not present
        inside = present and labels[self.key] in self.values
        return inside if self.operator == "In" else not inside


class LabelSelector(CamelModel):
    """The serving pods of one model, in the policy's namespace. Must not be empty:
    an empty selector would inject the sidecar into every pod of the namespace."""

    match_labels: dict[str, str] = Field(default_factory=dict)
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list, max_length=16)

    CEL_RULES = (
        CelRule(
            "(has(self.matchLabels) && size(self.matchLabels) > 0) || "
            "(has(self.matchExpressions) && size(self.matchExpressions) > 0)",
            "selector must name at least one label (matchLabels or matchExpressions); "
            "an empty selector would select every pod in the namespace",
            lambda s: bool(s.match_labels or s.match_expressions),
        ),
    )

    def matches(self, labels: dict[str, str] | None) -> bool:
        labels = labels or {}
        if any(labels.get(k) != v for k, v in self.match_labels.items()):
            return False
        return all(term.matches(labels) for term in self.match_expressions)


class WorkloadRef(CamelModel):
    """The serving workload the rollout drives (StatefulSet partition, or a Deployment
    by a stable/canary pair)."""

    kind: Literal["StatefulSet", "Deployment"]
    name: str = _name()


# --- model and hardware ----------------------------------------------------------------


class ModelSpec(CamelModel):
    """The served model: its cache key root and its shape (explicit, or a preset)."""

    id: str = _name()
    weights_version: str = Field(
        max_length=80,
        pattern=WEIGHTS_DIGEST_PATTERN,
        description="exact digest of the weights (sha256:<64 hex>); never a tag, "
        "because the cache key must change whenever the weights do",
    )
    kv_dtype: KvDtypeName = DEFAULT_KV_DTYPE.value
    rope_config_hash: str = Field(DEFAULT_ROPE_CONFIG_HASH, min_length=1, max_length=128)
    attn_impl: str = Field(DEFAULT_ATTN_IMPL_ID, min_length=1, max_length=128)
    preset: ModelPreset | None = Field(default=None, description="a named shape from kvtier.presets")
    shape: ModelShape | None = None

    CEL_RULES = (
        CelRule(
            "has(self.preset) != has(self.shape)",
            "model: give exactly one of preset or shape",
            lambda s: (s.preset is None) != (s.shape is None),
        ),
    )

    @property
    def dtype_bytes(self) -> int:
        return KvDtype(self.kv_dtype).itemsize

    # The CRD names two of the identity's fields its own way (`id`, `attnImpl`): these two
    # are the one mapping between them.
    def identity(self) -> ModelIdentity:
        """The key root minus the tenant that the policy's engines and sidecars serve."""
        return ModelIdentity(model_id=self.id, weights_version=self.weights_version, kv_dtype=self.kv_dtype,
                             rope_config_hash=self.rope_config_hash, attn_impl_id=self.attn_impl)

    @staticmethod
    def identity_wire(identity: ModelIdentity) -> dict[str, str]:
        """The `spec.model` fields that name `identity`, camelCase as applied."""
        return {"id": identity.model_id, "weightsVersion": identity.weights_version, "kvDtype": identity.kv_dtype,
                "ropeConfigHash": identity.rope_config_hash, "attnImpl": identity.attn_impl_id}


class Media(CamelModel):
    """Achievable fetch bandwidth of each medium, GB/s, per fetch."""

    dram_gbps: float = Field(DEFAULT_DRAM_GBPS, gt=0)
    rdma_gbps: float = Field(DEFAULT_RDMA_GBPS, gt=0)
    nvme_gbps: float = Field(DEFAULT_NVME_GBPS, gt=0)


class Hardware(CamelModel):
    """The GPUs recompute runs on: a preset, or dense TFLOP/s per GPU (never the 2:4
    sparsity figure), and the tensor-parallel degree."""

    gpu_preset: GpuPreset | None = Field(default=None, description="dense BF16 TFLOP/s from kvtier.presets")
    dense_tflops_per_gpu: float | None = Field(default=None, gt=0, le=100000)
    tp: int = Field(1, ge=1, le=64)
    media: Media = _section(Media)

    CEL_RULES = (
        CelRule(
            "has(self.gpuPreset) != has(self.denseTflopsPerGpu)",
            "hardware: give exactly one of gpuPreset or denseTflopsPerGpu",
            lambda s: (s.gpu_preset is None) != (s.dense_tflops_per_gpu is None),
        ),
    )


# --- tiers, admission, affinity ----------------------------------------------------------


# The smallest DRAM tier worth running: below this an arena holds a handful of blocks.
MIN_DRAM_CAPACITY = "1Mi"


class DramTier(CamelModel):
    capacity: str = Field("1Gi", max_length=32, pattern=QUANTITY_PATTERN, description=f"e.g. 64Gi; at least {MIN_DRAM_CAPACITY}")
    sidecar_memory_headroom: str | None = Field(
        default=None, max_length=32, pattern=QUANTITY_PATTERN,
        description="memory the sidecar process needs beyond its arena; the injected container requests and "
                    "is limited to capacity + headroom (default: measured base plus a per-slot allowance)",
    )

    CEL_RULES = (
        CelRule(
            f"quantity(self.capacity).compareTo(quantity('{MIN_DRAM_CAPACITY}')) >= 0",
            f"tiers.dram.capacity must be at least {MIN_DRAM_CAPACITY}, e.g. 64Gi",
            lambda s: parse_quantity_bytes(s.capacity) >= parse_quantity_bytes(MIN_DRAM_CAPACITY),
        ),
    )


class PeerTier(CamelModel):
    enabled: bool = True


class NvmeTier(CamelModel):
    """`off`; `shadow`: the sidecar measures real NVMe bandwidth and reports it without
    serving from it; `on`: serve from NVMe (batch traffic only)."""

    mode: Literal["off", "shadow", "on"] = "off"
    path: str = Field(
        DEFAULT_NVME_PATH, min_length=2, max_length=1024, pattern=r"^/",
        description="the node's NVMe mount (hostPath); shadow mode writes its probe file here",
    )


class Tiers(CamelModel):
    dram: DramTier = _section(DramTier)
    peer: PeerTier = _section(PeerTier)
    nvme: NvmeTier = _section(NvmeTier)


class AdmissionSpec(CamelModel):
    # The policy's admission section (kvtier.admission.FrequencyFilter is the runtime filter).
    min_sightings: int = Field(DEFAULT_MIN_SIGHTINGS, ge=1, le=16)
    thrash_ratio: float = Field(DEFAULT_THRASH_RATIO, gt=0, le=1)


class Affinity(CamelModel):
    """Rendezvous homes and spill; and the warm-up that precedes each new epoch: every
    moved tenant's hottest prefixes, at most `warmMaxBytes` each, copied to its new homes
    from its old ones, all within `warmTimeout` (then the epoch is published anyway)."""

    homes: int = Field(DEFAULT_HOMES, ge=1, le=16, description="rendezvous homes per tenant (k)")
    spill_occupancy: float = Field(
        DEFAULT_SPILL_OCCUPANCY, gt=DEFAULT_HYSTERESIS, lt=1,
        description=f"DRAM occupancy past which a tenant spills to its next home; above the routing "
                    f"hysteresis ({DEFAULT_HYSTERESIS}), or a spilled tenant could never return")
    balance_factor: float = Field(DEFAULT_BALANCE_FACTOR, ge=1, le=10)
    warm_max_bytes: str = Field(DEFAULT_WARM_MAX_BYTES, max_length=32, pattern=QUANTITY_PATTERN)
    warm_timeout: str = Field(DEFAULT_WARM_TIMEOUT, min_length=2, max_length=16, pattern=DURATION_PATTERN)

    @property
    def warm_max_bytes_int(self) -> int:
        return parse_quantity_bytes(self.warm_max_bytes)

    @property
    def warm_timeout_s(self) -> int:
        return parse_duration_s(self.warm_timeout)


# --- rollout -----------------------------------------------------------------------------


class PrometheusSource(CamelModel):
    """A PromQL query whose value is the new version's hit rate. Placeholders:
    `{{namespace}}`, `{{policy}}`, `{{version}}` (the version judged: the new one, or
    the old one for the baseline), `{{window}}` (the rate window: `analysisWindow`) and
    `{{minLookups}}`. No series, NaN or an unreachable server is inconclusive."""

    url: str = Field(min_length=1, max_length=2048, pattern=r"^https?://.+$")
    query: str = Field(DEFAULT_HIT_RATE_QUERY, min_length=1, max_length=4096)


class AlarmSource(CamelModel):
    """A named alert that fails a step while it fires for the new version (labels
    namespace, policy and version), read from Prometheus' alerts API or Alertmanager."""

    url: str = Field(min_length=1, max_length=2048, pattern=r"^https?://.+$")
    api: Literal["prometheus", "alertmanager"] = "prometheus"
    alert_name: str = Field(DEFAULT_ALARM_ALERT, min_length=1, max_length=253, pattern=r"^[A-Za-z_:][A-Za-z0-9_:]*$")


class Recovery(CamelModel):
    """When a rollout step counts as recovered: new-version pods' hit rate back to
    `threshold` x the old baseline within `window`, over at least `minLookups`.

    `source` says who measures: `sidecar` (the operator reads the pods' counters),
    `prometheus` (a templated query) or `alarm` (a named alert must not fire for the
    new version, and the new pods must have served `minLookups`). The last two take
    a measurement every `interval`: a step passes after `count` successes, fails after
    more than `failureLimit` failures (a hit rate below the bar counts as a failure only
    once `window` is over: a cold cache needs time), and pauses the rollout after more
    than `inconclusiveLimit` inconclusive measurements or `consecutiveErrorLimit` errors
    in a row; it resumes by itself once a measurement is conclusive again."""

    threshold: float = Field(DEFAULT_RECOVERY_THRESHOLD, gt=0, le=1)
    window: str = Field(DEFAULT_RECOVERY_WINDOW, min_length=2, max_length=16, pattern=DURATION_PATTERN)
    min_lookups: int = Field(DEFAULT_RECOVERY_MIN_LOOKUPS, ge=1)
    source: Literal["sidecar", "prometheus", "alarm"] = "sidecar"
    prometheus: PrometheusSource | None = None
    alarm: AlarmSource | None = None
    interval: str = Field(DEFAULT_ANALYSIS_INTERVAL, min_length=2, max_length=16, pattern=DURATION_PATTERN)
    analysis_window: str = Field("1m", min_length=2, max_length=16, pattern=DURATION_PATTERN,
                                 description="the {{window}} of the prometheus query")
    count: int = Field(DEFAULT_ANALYSIS_COUNT, ge=1, le=1000)
    failure_limit: int = Field(DEFAULT_ANALYSIS_FAILURE_LIMIT, ge=0, le=1000)
    inconclusive_limit: int = Field(DEFAULT_ANALYSIS_INCONCLUSIVE_LIMIT, ge=0, le=1000)
    consecutive_error_limit: int = Field(DEFAULT_ANALYSIS_CONSECUTIVE_ERROR_LIMIT, ge=0, le=1000)

    CEL_RULES = (
        CelRule(
            "(self.source == 'prometheus') == has(self.prometheus)",
            "rollout.recovery: source prometheus needs prometheus {url, query}, and only it takes one",
            lambda s: (s.source == "prometheus") == (s.prometheus is not None),
        ),
        CelRule(
            "(self.source == 'alarm') == has(self.alarm)",
            "rollout.recovery: source alarm needs alarm {url, api, alertName}, and only it takes one",
            lambda s: (s.source == "alarm") == (s.alarm is not None),
        ),
    )

    @property
    def window_s(self) -> int:
        return parse_duration_s(self.window)

    @property
    def interval_s(self) -> int:
        return parse_duration_s(self.interval)


class Warmup(CamelModel):
    """Warm-before-ready: each pod a rollout moves to the new weights version is held
    out of traffic by the readiness gate `kvtier.io/warm` until it has prefilled its
    tenants' hottest prefixes (first from its own sidecar, read just before the pod
    restarted, then from the tenants' other homes' sidecars; ranked by frequency x
    length) through its own engine, at most `maxTokens` prompt tokens within `timeout`;
    then the gate is released, warm or not. `maxTokens: 0` turns it off."""

    max_tokens: int = Field(DEFAULT_ROLLOUT_WARM_TOKENS, ge=0, le=MAX_ROLLOUT_WARM_TOKENS,
                            description="per-pod prefill budget in prompt tokens (0: no warm-up)")
    timeout: str = Field(DEFAULT_ROLLOUT_WARM_TIMEOUT, min_length=2, max_length=16, pattern=DURATION_PATTERN,
                         description="the per-pod deadline, e.g. 2m; then the gate is released anyway")
    engine_port: int = Field(DEFAULT_ENGINE_PORT, ge=1, le=65535,
                             description="the engine container's OpenAI-compatible HTTP port")
    served_model_name: str | None = Field(default=None, min_length=1, max_length=_MAX_NAME,
                                          description="the engine's served model name (default: model.id)")

    CEL_RULES = (
        CelRule(
            f"duration(self.timeout) >= duration('1s') && duration(self.timeout) <= duration('{MAX_ROLLOUT_WARM_TIMEOUT_S}s')",
            "rollout.warmup.timeout must be between 1s and 1h, e.g. 2m: past it a new pod waits out of traffic",
            lambda s: 1 <= parse_duration_s(s.timeout) <= MAX_ROLLOUT_WARM_TIMEOUT_S,
        ),
    )

    @property
    def timeout_s(self) -> int:
        return parse_duration_s(self.timeout)


class Rollout(CamelModel):
    """Weights-version rollout: `canaryPods` new-version pods first, then `steps`
    (percent of the fleet, strictly increasing, ending at 100)."""

    canary_pods: int = Field(DEFAULT_CANARY_PODS, ge=0, le=1000)
    steps: list[int] = Field(
        default_factory=lambda: list(DEFAULT_ROLLOUT_STEPS),
        min_length=1,
        max_length=_MAX_STEPS,
        json_schema_extra={
            "items": {"type": "integer", "minimum": 1, "maximum": 100},
            "default": list(DEFAULT_ROLLOUT_STEPS),
        },
    )
    recovery: Recovery = _section(Recovery)
    on_failure: Literal["rollback", "pause"] = "rollback"
    warmup: Warmup | None = Field(default=None, description="warm-before-ready (absent: new pods start cold)")

    @property
    def warms(self) -> bool:
        """Warm-before-ready is on: a warmup section with a budget."""
        return self.warmup is not None and self.warmup.max_tokens > 0

    CEL_RULES = (
        CelRule(
            "self.steps.isSorted() && self.steps.all(s, self.steps.filter(t, t == s).size() == 1) "
            "&& self.steps[size(self.steps) - 1] == 100",
            "rollout.steps must be strictly increasing percentages ending at 100, e.g. [10, 50, 100]",
            lambda s: all(a < b for a, b in zip(s.steps, s.steps[1:])) and s.steps[-1] == 100,
        ),
    )


# --- redis and shared prefixes --------------------------------------------------------------


class SecretKeyRef(CamelModel):
    name: str = _name()
    key: str = Field("url", min_length=1, max_length=_MAX_NAME)


class RedisSpec(CamelModel):
    """Where the global block index lives: a URL, or a Secret holding one."""

    url: str | None = Field(default=None, max_length=2048, pattern=REDIS_URL_PATTERN)
    secret_ref: SecretKeyRef | None = None
    cluster: bool = Field(
        default=False,
        description="the URL names one node of a Redis Cluster; the sidecars and the operator "
                    "use the cluster client (keys of one key root share a hash tag)",
    )

    CEL_RULES = (
        CelRule(
            "has(self.url) != has(self.secretRef)",
            "redis: give exactly one of url or secretRef",
            lambda s: (s.url is None) != (s.secret_ref is None),
        ),
    )


class SharedPrefix(CamelModel):
    """A platform-owned prefix (e.g. the platform's own system prompt) that may be
    shared across tenants (rule: tenant-isolation); every other prefix stays per tenant."""

    name: str = Field(min_length=1, max_length=63)
    token_ids: list[int] = Field(
        min_length=1,
        max_length=_MAX_PREFIX_TOKENS,
        json_schema_extra={"items": {"type": "integer", "minimum": 0, "maximum": 4294967295}},
    )


# --- one KV block, in CEL and in Python ---------------------------------------------------
# The sidecar's arena must hold at least one block (`SidecarConfig`): a policy whose DRAM
# tier cannot is refused at apply time. The CEL computes the same bytes as
# `kv_block_bytes`: the presets' elements per token are written into the rule.

def _cel_map(values: dict[str, int]) -> str:
    return "{" + ", ".join(f"'{k}': {v}" for k, v in sorted(values.items())) + "}"


_CEL_KV_ELEMENTS = (
    f"(has(self.model.preset) ? {_cel_map({n: m.kv_elements() for n, m in presets.MODELS.items()})}[self.model.preset]"
    " : has(self.model.shape.kvElementsPerToken) ? self.model.shape.kvElementsPerToken"
    " : 2 * self.model.shape.layers * self.model.shape.kvHeads * self.model.shape.headDim)"
)
_CEL_KV_TOKEN_BYTES = f"({_CEL_KV_ELEMENTS} * {_cel_map(KV_DTYPE_BYTES)}[self.model.kvDtype])"
_CEL_BLOCK_BYTES = f"({_CEL_KV_TOKEN_BYTES} * self.blockSize)"


def kv_token_bytes(spec: "KVCachePolicySpec") -> int:
    """KV bytes one token takes in the sidecar's arena (every layer, K and V or a latent)."""
    shape = presets.model_preset(spec.model.preset) if spec.model.preset is not None else spec.model.shape
    assert shape is not None  # the model's CEL rule: exactly one of preset or shape
    return shape.kv_bytes_per_token(spec.model.kv_dtype)


def kv_block_bytes(spec: "KVCachePolicySpec") -> int:
    return kv_token_bytes(spec) * spec.block_size


def _dram_holds_a_block(spec: "KVCachePolicySpec") -> bool:
    return parse_quantity_bytes(spec.tiers.dram.capacity) >= kv_block_bytes(spec)


# The apiserver's message is static (a messageExpression computing the bytes costs more
# than the CEL budget allows); the operator's adds this policy's numbers.
DRAM_BLOCK_MESSAGE = ("tiers.dram.capacity cannot hold one KV block (blockSize tokens x the model's KV bytes per "
                      "token: 5 MiB for llama-3-70b at fp16 and blockSize 16): raise tiers.dram.capacity or "
                      "lower blockSize")


def _dram_block_message(spec: "KVCachePolicySpec") -> str:
    return (f"{DRAM_BLOCK_MESSAGE}; here one block is {kv_block_bytes(spec)} bytes and tiers.dram.capacity "
            f"{spec.tiers.dram.capacity} is {parse_quantity_bytes(spec.tiers.dram.capacity)}")


# --- spec ----------------------------------------------------------------------------------


class KVCachePolicySpec(CamelModel):
    """What the operator keeps true for the pods `selector` picks."""

    selector: LabelSelector
    workload_ref: WorkloadRef | None = None
    model: ModelSpec
    hardware: Hardware
    traffic_class: Literal["interactive", "batch"] = "interactive"
    block_size: int = Field(DEFAULT_BLOCK_SIZE, ge=1, le=1024)
    tiers: Tiers = _section(Tiers)
    admission: AdmissionSpec = _section(AdmissionSpec)
    affinity: Affinity = _section(Affinity)
    rollout: Rollout = _section(Rollout)
    redis: RedisSpec | None = None
    shared_prefixes: list[SharedPrefix] = Field(
        default_factory=list,
        max_length=_MAX_SHARED_PREFIXES,
        description=f"at most {_MAX_SHARED_PREFIXES} prefixes and {MAX_SHARED_PREFIX_TOKENS_TOTAL} token ids "
                    "in all, so the rendered sidecar config stays under a quarter of a ConfigMap's 1 MiB",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )

    CEL_RULES = (
        CelRule(
            "self.trafficClass == 'batch' || self.tiers.nvme.mode != 'on'",
            "tiers.nvme.mode 'on' is for trafficClass batch only: interactive traffic would "
            "wait on a fetch slower than recomputing; use 'shadow' to measure NVMe instead",
            lambda s: s.traffic_class == "batch" or s.tiers.nvme.mode != "on",
        ),
        CelRule(
            "self.rollout.canaryPods > 0 || self.rollout.steps[0] < 100 || size(self.rollout.steps) > 1",
            "rollout: a single 100% step with no canary pods is not gradual; add canaryPods or earlier steps",
            lambda s: s.rollout.canary_pods > 0 or s.rollout.steps[0] < 100 or len(s.rollout.steps) > 1,
        ),
        CelRule(
            "!(has(self.model.preset) || has(self.model.shape)) || "
            f"quantity(self.tiers.dram.capacity).asApproximateFloat() >= double({_CEL_BLOCK_BYTES})",
            DRAM_BLOCK_MESSAGE,
            _dram_holds_a_block,
            describe=_dram_block_message,
        ),
        CelRule(
            f"!has(self.sharedPrefixes) || self.sharedPrefixes.map(p, size(p.tokenIds)).sum() <= {MAX_SHARED_PREFIX_TOKENS_TOTAL}",
            f"sharedPrefixes: at most {MAX_SHARED_PREFIX_TOKENS_TOTAL} token ids in all (they are rendered into "
            "the sidecar's ConfigMap); shorten or drop prefixes",
            lambda s: sum(len(p.token_ids) for p in s.shared_prefixes) <= MAX_SHARED_PREFIX_TOKENS_TOTAL,
        ),
    )


# --- status --------------------------------------------------------------------------------


class Condition(CamelModel):
    """The Kubernetes Condition shape (metav1.Condition)."""

    type: str = Field(min_length=1, max_length=316)
    status: Literal["True", "False", "Unknown"]
    observed_generation: int | None = Field(default=None, ge=0)
    last_transition_time: datetime
    reason: str = Field(min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = Field("", max_length=32768)


class TierVerdict(CamelModel):
    """One medium against the break-even bandwidth: does fetching beat recomputing?"""

    tier: Literal["dram", "peer", "nvme"]
    bandwidth_gbps: float
    break_even_gbps: float
    ratio: float = Field(description="bandwidth / break-even; >= 1 helps latency")
    verdict: Literal["serve", "shadow", "refused", "off"]
    reason: str = ""
    measured_gbps: float | None = Field(default=None, description="shadow mode: measured by the sidecars")


# A rollout step's new pods measured over their first minute of traffic: at most this
# many pods in windows at once (status.rollout.firstMinutePods), named per step.
MAX_FIRST_MINUTE_PODS = 128


class Counters(CamelModel):
    """A pod's sidecar counters (since its cache started): lookups, and the hit figure's
    tokens, loaded (as the engine reported them) over prompt (looked up)."""

    lookups: int = Field(0, ge=0)
    loaded_tokens: int = Field(0, ge=0)
    prompt_tokens: int = Field(0, ge=0)


class PodFirstMinute(CamelModel):
    """One new-version pod in its first minute of traffic: its counters when it first
    served (its warm-up's own prefill before that is not counted), and once the window
    is over, what it counted over it."""

    pod: str = Field(max_length=_MAX_NAME)
    step: int = Field(ge=1, description="the rollout step it came up in")
    warm: bool = Field(False, description="its warm-before-ready prefilled at least one prompt")
    started_at: datetime
    start: Counters
    window: Counters | None = Field(default=None, description="counted over the window (set when it is over)")


class FirstMinute(CamelModel):
    """A rollout step's new pods over their first minute of traffic each (from their
    sidecars' loaded-token counters, the recovery check's figure), next to the old
    version's hit rate then, the pods counted warm (warmed before Ready) vs cold."""

    step: int = Field(ge=1)
    window_s: float = Field(ge=0, description="each pod's window, from its first tick serving")
    pods: int = Field(0, ge=0)
    warm_pods: int = Field(0, ge=0)
    cold_pods: int = Field(0, ge=0)
    lookups: int = Field(0, ge=0)
    loaded_tokens: int = Field(0, ge=0)
    prompt_tokens: int = Field(0, ge=0)
    hit_rate: float | None = Field(default=None, description="loaded / prompt tokens of the step's new pods")
    warm_hit_rate: float | None = None
    cold_hit_rate: float | None = None
    baseline_hit_rate: float | None = Field(default=None, description="the old version's hit rate at that time")
    baseline_source: Literal["oldPods", "rolloutStart"] | None = Field(
        default=None, description="oldPods: the old version's pods then; rolloutStart: none left, the "
                                  "rollout's baseline")
    started_at: datetime = Field(description="the first of its pods' windows opened")
    measured_at: datetime
    pod_names: list[str] = Field(default_factory=list, max_length=MAX_FIRST_MINUTE_PODS,
                                 json_schema_extra={"items": {"type": "string", "maxLength": _MAX_NAME}})


class RolloutRecord(CamelModel):
    """One finished or abandoned step of a rollout, for `status.rollout.history`."""

    version: str = Field(max_length=80)
    step: int
    outcome: Literal["recovered", "rolledBack", "paused", "completed", "promoted", "aborted", "resumed", "caughtUp"]
    hit_rate: float | None = None
    time: datetime
    message: str = ""
    first_minute: FirstMinute | None = Field(
        default=None, description="the step's new pods' hit rate in their first minute of traffic")


# status.rollout.warmups entries kept (one per pod a rollout moved; the newest).
MAX_WARMUPS = 64


class PodWarmup(CamelModel):
    """How one pod's warm-before-ready went (`spec.rollout.warmup`): what it prefilled
    through its engine before its readiness gate was released."""

    pod: str = Field(max_length=_MAX_NAME)
    version: str = Field(max_length=80)
    outcome: Literal["Warmed", "WarmupFailed", "WarmupTimedOut"]
    tokens: int = Field(0, ge=0, description="prompt tokens prefilled")
    prompts: int = Field(0, ge=0)
    tenants: int = Field(0, ge=0, description="tenants with at least one prefix prefilled")
    cold_tenants: int = Field(0, ge=0, description="the pod's tenants left cold (nothing to warm from, or failed)")
    budget_tokens: int = Field(0, ge=0, description="min(maxTokens, capacityTokens): the pod's prefill budget")
    capacity_tokens: int | None = Field(
        default=None, ge=0, description="what the capacity estimate says the pod's engine prefills within its "
                                        "warm-up deadline (none: no estimate)")
    seconds: float = Field(0.0, ge=0)
    finished_at: datetime
    message: str = Field("", max_length=1024)


class AnalysisStatus(CamelModel):
    """The measurements of the current step (prometheus and alarm sources)."""

    successes: int = Field(0, ge=0)
    failures: int = Field(0, ge=0)
    inconclusives: int = Field(0, ge=0)
    consecutive_errors: int = Field(0, ge=0)
    measured_at: datetime | None = None
    last_result: Literal["successful", "failed", "pending", "inconclusive", "error"] | None = None
    last_value: float | None = None
    message: str = Field("", max_length=1024)


class RolloutStatus(CamelModel):
    """Where a weights-version rollout stands; the operator resumes from it."""

    target_version: str | None = Field(default=None, max_length=80)
    step: int = 0
    canary_percent: int = Field(0, ge=0, le=100)
    baseline_hit_rate: float | None = None
    current_hit_rate: float | None = None
    step_started_at: datetime | None = None
    expected_cold_prefill_tokens_per_s: float | None = None
    analysis: AnalysisStatus | None = None
    paused_reason: Literal["failure", "inconclusive", "manual"] | None = Field(
        default=None, description="why phase is Paused: an inconclusive pause resumes by itself")
    handled_request: str | None = Field(default=None, max_length=128,
                                        description=f"the last {names.ROLLOUT_REQUEST_ANNOTATION} acted on")
    history: list[RolloutRecord] = Field(default_factory=list, max_length=MAX_HISTORY)
    warmups: list[PodWarmup] = Field(default_factory=list, max_length=MAX_WARMUPS,
                                     description="warm-before-ready, per pod this rollout moved (the newest)")
    first_minute_pods: list[PodFirstMinute] = Field(
        default_factory=list, max_length=MAX_FIRST_MINUTE_PODS,
        description="new-version pods in their first minute of traffic, not yet summed up per step")
    first_minutes: list[FirstMinute] = Field(
        default_factory=list, max_length=MAX_HISTORY,
        description="per step of this rollout: its new pods' hit rate in their first minute of traffic")


class KVCachePolicyStatus(CamelModel):
    """What the operator observed and decided. Everything it needs to resume after a
    restart lives here or in `kvtier.io/` annotations."""

    observed_generation: int | None = None
    phase: Literal["Pending", "Ready", "Degraded", "RollingOut", "Paused", "RolledBack"] | None = None
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=_MAX_CONDITIONS,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    version: str | None = Field(default=None, max_length=80, description="weights version the fleet serves")
    member_count: int | None = None
    members: list[str] = Field(default_factory=list, description="ready member pods (name=ip)")
    epoch: int | None = Field(default=None, description="affinity table epoch last published")
    moved_tenants: int | None = Field(default=None, description="tenants whose homes changed at the last epoch")
    known_tenants: int | None = None
    uninjected_pods: int | None = Field(default=None, description="selected pods running without the sidecar "
                                        "(created while the webhook was unreachable)")
    uninjected_pod_names: list[str] = Field(default_factory=list, max_length=_MAX_UNINJECTED_NAMED,
                                            description=f"the first {_MAX_UNINJECTED_NAMED} of them, by name")
    fleet_hit_rate: float | None = None
    affinity_config_map: str | None = None
    sidecar_config_map: str | None = None
    sidecar_config_hash: str | None = None
    tiers: list[TierVerdict] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["tier"]},
    )
    rollout: RolloutStatus | None = None


class KVCachePolicy(CamelModel):
    """The whole object as the operator reads it (metadata kept as a plain mapping)."""

    model_config = ConfigDict(extra="ignore")

    api_version: str = API_VERSION
    kind: Literal["KVCachePolicy"] = KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: KVCachePolicySpec
    status: KVCachePolicyStatus | None = None


# --- helpers -------------------------------------------------------------------------------

_DURATION_RE = re.compile(DURATION_PATTERN)
_QUANTITY_SUFFIX = {
    "": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
}


def parse_duration_s(text: str) -> int:
    """'30m' -> 1800; '1h30m' -> 5400. ValueError for anything else."""
    m = _DURATION_RE.match(text)
    if not text or not m or not any(m.groups()):
        raise ValueError(f"duration {text!r}: use hours/minutes/seconds like 30m or 1h30m")
    total = 0
    for group, unit_s in zip(m.groups(), (3600, 60, 1)):
        if group:
            total += int(group[:-1]) * unit_s
    return total


def parse_quantity_bytes(text: str) -> int:
    """'64Gi' -> 68719476736 (Kubernetes quantity, binary or decimal suffix)."""
    m = re.match(r"^([0-9]+(?:\.[0-9]+)?)([A-Za-z]*)$", text)
    if not m or m.group(2) not in _QUANTITY_SUFFIX:
        raise ValueError(f"quantity {text!r}: use a number with an optional suffix like 64Gi or 500M")
    return int(float(m.group(1)) * _QUANTITY_SUFFIX[m.group(2)])


def parse_policy(body: dict[str, Any]) -> KVCachePolicy:
    """Parse a KVCachePolicy as read from the apiserver (or a YAML file)."""
    return KVCachePolicy.model_validate(body)
