"""The sidecar's configuration: one pydantic model, rendered by the operator into a
ConfigMap and read by `kvtier-sidecar --config FILE`.

File format: YAML or JSON (a JSON document is valid YAML), one mapping whose keys are
the fields of `SidecarConfig` below; every field has a default, so `{}` is a valid
file. Example::

    model:
      model_id: llama-3-70b
      weights_version: sha256:9f2c...      # exact digest; env KVTIER_WEIGHTS_VERSION wins
      layers: 80
      kv_heads: 8
      head_dim: 128
      dtype_bytes: 2
    block_size: 16
    dram_capacity_bytes: 8589934592
    min_sightings: 2
    thrash_ratio: 0.9
    nvme: {mode: shadow, path: /var/lib/kvtier/nvme}   # off | shadow | on
    peer_enabled: true
    redis_url: redis://kvtier-redis:6379/0
    peer_secret_file: /var/run/kvtier/peer-secret
    control_tls: {cert_file: /etc/kvtier/tls/tls.crt, key_file: /etc/kvtier/tls/tls.key}
    platform_prefixes: [[128000, 882, 25]]

The downward API supplies the pod's identity through the environment: POD_NAME,
POD_NAMESPACE, POD_IP and KVTIER_WEIGHTS_VERSION override the file (see `from_env`).

Fields marked reloadable in `RELOADABLE_FIELDS` take effect when the file changes; the
others shape the arena and the listeners and need a restart (a changed value is
logged and ignored, never applied half-way).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvtier import names
from kvtier.admission import DEFAULT_MIN_SIGHTINGS
from kvtier.admission import THRASH_RATIO as DEFAULT_THRASH_RATIO
from kvtier.dtypes import DEFAULT_KV_DTYPE
from kvtier.identity import ModelIdentity
from kvtier.keys import DEFAULT_BLOCK_SIZE
from kvtier.presets import kv_bytes_per_token, kv_elements_fit, kv_plane_elements, kv_planes

# 1 GiB of host DRAM: small enough for a laptop demo; production sets hundreds of GiB.
DEFAULT_DRAM_CAPACITY_BYTES = 1 << 30
# A peer fetch that has not finished in this time is slower than recomputing it.
DEFAULT_PEER_TIMEOUT_S = 2.0
# Index entries outlive a typical eviction horizon; stale ones only cost a wasted fetch.
DEFAULT_INDEX_TTL_S = 600
# Prometheus series per metric stay bounded: top-N tenants get a label, the rest "other".
DEFAULT_METRICS_TOP_TENANTS = 20
# Tenants listed in whole-cache stats (most bytes first): the operator learns a
# replica's tenants from them (~136 each in the design's fleet); bounded for a scrape.
DEFAULT_STATS_MAX_TENANTS = 1000
# NVMe shadow probe: a few tens of MiB written, fsynced and read back measures the
# device rather than its cache, in well under a second on a 7 GB/s drive ...
DEFAULT_NVME_PROBE_BYTES = 32 << 20
# ... repeated this often (a slow timer: the probe competes with nothing it serves) ...
DEFAULT_NVME_PROBE_INTERVAL_S = 300.0
# ... and abandoned past this budget (a sick disk must not hold a thread for long).
DEFAULT_NVME_PROBE_BUDGET_S = 5.0
# Graceful leave: after SIGTERM a draining sidecar keeps serving peers this long at
# most, so the operator can warm the departing pod's tenants on their new homes from it
# (the simulator: hit-rate dip after a leave 0.037 without that warm-up, 0.006 with) ...
DEFAULT_DRAIN_TIMEOUT_S = 20.0
# ... or until neither a peer connection nor a control request (the operator reads stats
# before it warms) arrived for this long: nobody is warming from it. Under a test's
# 10 s graceful stop, above an operator's reaction to a pod deletion.
DEFAULT_DRAIN_IDLE_S = 5.0
# Peer secret rotation: the previous secret stays accepted this long after the file
# changed. A mounted Secret reaches pods up to the kubelet's sync period (60 s) plus its
# cache TTL (60 s) apart; three minutes covers that with room.
DEFAULT_PEER_SECRET_OVERLAP_S = 180.0
# The shortest peer secret a sidecar accepts: 32 bytes (128 bits as the hex text the
# test fleets write; the operator writes 64 random hex digits, 256 bits). An empty or
# short secret would let anyone who guesses it into every sidecar of the fleet.
MIN_PEER_SECRET_BYTES = 32

# Where Kubernetes mounts a pod's ServiceAccount token and the cluster CA.
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# The audience the operator's projected token is minted for: a token meant for the API
# server (or anything else) is not accepted by a sidecar, nor a sidecar's by anything else.
DEFAULT_CONTROL_AUDIENCE = "kvtier-sidecar"
# TokenReview answers are reused this long (kube-rbac-proxy caches likewise): the
# operator's calls cost the API server one review per half minute, and a revoked token
# keeps working at most this long.
DEFAULT_CONTROL_AUTH_CACHE_TTL_S = 30.0

RELOADABLE_FIELDS = frozenset({
    "log_level",
    "peer_timeout_s",
    "peer_connect_timeout_s",
    "index_ttl_s",
    "index_lookup_timeout_s",
    "metrics_top_tenants",
    "stats_max_tenants",
    "platform_prefixes",
    "platform_tenant",
    "model",
    "nvme",
    "drain_timeout_s",
    "drain_idle_s",
    "warm_peers",
})

class PeerSecretError(ValueError):
    """The peer tier is on, but its secret is missing, empty or too short to trust."""


def check_peer_secret(secret: bytes, where: str) -> bytes:
    """`secret` when it is long enough to authenticate peers; PeerSecretError (saying
    what to fix) otherwise. `where` names its source for the message."""
    if len(secret) < MIN_PEER_SECRET_BYTES:
        what = "is empty" if not secret else f"holds {len(secret)} bytes"
        raise PeerSecretError(
            f"peer secret {where} {what}: the peer tier needs a shared secret of at least "
            f"{MIN_PEER_SECRET_BYTES} bytes (the operator's <policy>-kvtier-peer Secret holds 64 random hex "
            f"digits); mount that Secret and point peer_secret_file at it, or set peer_enabled: false")
    return secret


_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,253}$")


class ServedModel(ModelIdentity):
    """The served model's identity (`identity.ModelIdentity`: the key root minus the tenant)
    and KV layout (the block size in bytes). Its dimensions are a `presets.ModelShape`'s,
    with the same override and the same bytes per token (`presets.kv_bytes_per_token`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    layers: int = Field(2, ge=1, le=1024)
    kv_heads: int = Field(2, ge=1, le=1024)
    head_dim: int = Field(16, ge=1, le=4096)
    # The engine's kv_dtype is its own name (vLLM's "bfloat16"): its size is given here.
    dtype_bytes: int = Field(DEFAULT_KV_DTYPE.itemsize, ge=1, le=8)
    # Caches that are not one K and one V per kv head set this: multi-head latent
    # attention (DeepSeek-V3) keeps ONE latent of head_dim per layer, i.e.
    # layers x kv_heads x head_dim elements; None means K and V (twice that).
    kv_elements_per_token: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _override_is_whole_planes(self) -> "ServedModel":
        if self.kv_elements_per_token is not None and not kv_elements_fit(
            self.layers, self.kv_heads, self.head_dim, self.kv_elements_per_token
        ):
            raise ValueError(
                f"model.kv_elements_per_token={self.kv_elements_per_token} must be "
                f"layers x kv_heads x head_dim = {self._plane_elements()} (one latent per "
                f"layer, MLA) or twice that (K and V); adjust head_dim/kv_heads to the cache's shape"
            )
        return self

    def _plane_elements(self) -> int:
        return kv_plane_elements(self.layers, self.kv_heads, self.head_dim)

    @property
    def kv_planes(self) -> int:
        """2 (K and V) for ordinary attention, 1 for a latent cache (MLA)."""
        return kv_planes(self.layers, self.kv_heads, self.head_dim, self.kv_elements_per_token)

    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, self.dtype_bytes,
                                  self.kv_elements_per_token)


class NvmeConfig(BaseModel):
    """The local-disk tier. `shadow` measures the disk under `path` (write + fsync +
    read back, O_DIRECT where the filesystem allows) on a slow timer and reports the
    bandwidth in stats without serving from it; `on` is refused for serving by this
    sidecar (not implemented) and behaves as `shadow`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["off", "shadow", "on"] = "off"
    path: str = Field("/var/lib/kvtier/nvme", min_length=1, max_length=1024)
    probe_bytes: int = Field(DEFAULT_NVME_PROBE_BYTES, ge=1 << 20, le=1 << 30)
    probe_interval_s: float = Field(DEFAULT_NVME_PROBE_INTERVAL_S, ge=1.0)
    probe_budget_s: float = Field(DEFAULT_NVME_PROBE_BUDGET_S, gt=0)

    @property
    def measuring(self) -> bool:
        return self.mode != "off"


class ControlAuthConfig(BaseModel):
    """Who may use the mutating control endpoints (invalidate, warm, drain/done) and
    per-tenant stats. `tokenreview`: a bearer token the API server's TokenReview says is
    valid for `audience` and belongs to one of `allowed_users` (the operator's
    ServiceAccount, `system:serviceaccount:<ns>:<name>`); none -> 401, someone else ->
    403. `open`: no check (a sidecar on loopback in tests and the local demo only).
    /healthz and /readyz are always open; /metrics too unless `protect_metrics`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["open", "tokenreview"] = "tokenreview"
    # A pod's own audience (`control_api.pod_audience`) holds its namespace and name.
    audience: str = Field(DEFAULT_CONTROL_AUDIENCE, min_length=1, max_length=400)
    # Protected /metrics also takes tokens for this shared audience: a scraper cannot
    # hold one token per pod.
    metrics_audience: str = Field(DEFAULT_CONTROL_AUDIENCE, min_length=1, max_length=253)
    allowed_users: list[str] = Field(default_factory=list, max_length=100)
    protect_metrics: bool = False
    metrics_users: list[str] = Field(default_factory=list, max_length=100)  # /metrics only (e.g. Prometheus)
    cache_ttl_s: float = Field(DEFAULT_CONTROL_AUTH_CACHE_TTL_S, ge=0, le=600)
    api_server: str = ""  # empty: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT
    token_file: str = f"{SERVICE_ACCOUNT_DIR}/token"  # this sidecar's own token (to call TokenReview)
    ca_file: str = f"{SERVICE_ACCOUNT_DIR}/ca.crt"


class ControlTlsConfig(BaseModel):
    """TLS of the HTTP control API (`kvtier.control_tls`). With `cert_file` and
    `key_file` (PEM; the webhook mounts the policy's Secret issued by the operator's CA)
    the port speaks HTTPS only: a plain HTTP request gets no answer. Neither set is
    refused at start-up unless `plain_http` says so explicitly (loopback tests and a
    single-host lab only; logged as a warning at start)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cert_file: str = ""
    key_file: str = ""
    plain_http: bool = False

    @model_validator(mode="after")
    def _one_protocol(self) -> "ControlTlsConfig":
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("control_tls: set both cert_file and key_file (PEM), or neither")
        if self.plain_http and self.cert_file:
            raise ValueError("control_tls: plain_http with a cert_file: choose one (the port speaks one protocol)")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)

    def require_choice(self) -> None:
        """What `kvtier-sidecar` checks before it serves: TLS, or plain HTTP said out loud."""
        if not self.plain_http and not self.cert_file:
            raise ValueError(
                "control_tls: the control API serves HTTPS only: set control_tls.cert_file and key_file "
                "(env KVTIER_CONTROL_TLS_CERT_FILE / KVTIER_CONTROL_TLS_KEY_FILE; the operator's webhook "
                "mounts the policy's certificate), or set control_tls.plain_http: true to serve it "
                "unencrypted (a lab on loopback only)")


def pod_shm_name(namespace: str, pod: str) -> str:
    """The sidecar arena's POSIX shared-memory name for a pod, unique per (namespace,
    pod) so sidecars sharing a host never collide; short because macOS caps names at
    31 bytes. Its identity lock is `<name>.lock` beside it."""
    digest = hashlib.blake2b(f"{namespace}/{pod}".encode(), digest_size=8).hexdigest()
    return f"kvt-{digest}"


class SidecarConfig(BaseModel):
    """Everything one sidecar needs; see the module docstring for the file format."""

    model_config = ConfigDict(extra="forbid")

    pod_name: str = "kvtier-local"
    pod_namespace: str = "default"
    pod_ip: str = "127.0.0.1"

    model: ServedModel = ServedModel()
    block_size: int = Field(DEFAULT_BLOCK_SIZE, ge=1, le=4096)
    dram_capacity_bytes: int = Field(DEFAULT_DRAM_CAPACITY_BYTES, ge=1)
    min_sightings: int = Field(DEFAULT_MIN_SIGHTINGS, ge=1, le=16)
    thrash_ratio: float = Field(DEFAULT_THRASH_RATIO, gt=0, le=1)
    nvme: NvmeConfig = NvmeConfig()

    http_port: int = Field(8081, ge=0, le=65535)
    peer_port: int = Field(8082, ge=0, le=65535)
    peer_advertise: str = ""  # host:port peers dial; empty: pod_ip:peer_port
    engine_socket: str = ""  # empty: derived from pod identity under the runtime dir

    redis_url: str | None = None  # None: no global index, the peer tier is off
    redis_cluster: bool = False  # True: talk to a Redis Cluster through the cluster client
    index_ttl_s: int = Field(DEFAULT_INDEX_TTL_S, ge=1)
    index_lookup_timeout_s: float = Field(0.05, gt=0)
    index_key_prefix: str = "kvt"

    peer_enabled: bool = True  # False: no peer server, no peer fetches, no warm-ups, no index
    peer_secret_file: str | None = None
    peer_secret_overlap_s: float = Field(DEFAULT_PEER_SECRET_OVERLAP_S, ge=0, le=3600)
    # Peers a warm-up may dial besides the global index's live members (host:port).
    warm_peers: list[str] = Field(default_factory=list, max_length=10_000)
    peer_max_concurrency: int = Field(8, ge=1, le=1024)
    peer_timeout_s: float = Field(DEFAULT_PEER_TIMEOUT_S, gt=0)
    peer_connect_timeout_s: float = Field(0.25, gt=0)
    drain_timeout_s: float = Field(DEFAULT_DRAIN_TIMEOUT_S, ge=0, le=3600)  # 0: exit at once on SIGTERM
    drain_idle_s: float = Field(DEFAULT_DRAIN_IDLE_S, gt=0, le=3600)

    platform_tenant: str = "platform"
    platform_prefixes: list[list[int]] = Field(default_factory=list)

    control_auth: ControlAuthConfig = ControlAuthConfig()
    # A sidecar refuses to start with neither a certificate nor plain_http (`require_choice`).
    control_tls: ControlTlsConfig = ControlTlsConfig()

    metrics_top_tenants: int = Field(DEFAULT_METRICS_TOP_TENANTS, ge=1, le=1000)
    stats_max_tenants: int = Field(DEFAULT_STATS_MAX_TENANTS, ge=1, le=100_000)
    log_level: str = "INFO"

    @field_validator("pod_name", "pod_namespace")
    @classmethod
    def _dns_like(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError(f"{v!r} is not a valid pod name/namespace (letters, digits, . _ -)")
        return v

    @field_validator("log_level")
    @classmethod
    def _level(cls, v: str) -> str:
        up = v.upper()
        if up not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise ValueError(f"log_level {v!r}: use DEBUG, INFO, WARNING or ERROR")
        return up

    @field_validator("platform_prefixes")
    @classmethod
    def _token_ids(cls, v: list[list[int]]) -> list[list[int]]:
        for prefix in v:
            if not prefix or any(not (0 <= t < 2**32) for t in prefix):
                raise ValueError("platform_prefixes: each prefix is a non-empty list of uint32 token ids")
        return v

    @model_validator(mode="after")
    def _arena_holds_a_block(self) -> "SidecarConfig":
        if self.dram_capacity_bytes < self.block_bytes:
            raise ValueError(
                f"dram_capacity_bytes={self.dram_capacity_bytes} is smaller than one block "
                f"({self.block_bytes} bytes): raise it or shrink the model shape"
            )
        return self

    @property
    def block_bytes(self) -> int:
        return self.model.kv_bytes_per_token() * self.block_size

    @property
    def slots(self) -> int:
        return self.dram_capacity_bytes // self.block_bytes

    @property
    def shm_name(self) -> str:
        return pod_shm_name(self.pod_namespace, self.pod_name)

    def engine_socket_path(self, env: Mapping[str, str] | None = None) -> str:
        """The engine socket; an engine in the same pod derives the same path from the
        same identity and its own environment (`env`, default os.environ)."""
        if self.engine_socket:
            return self.engine_socket
        runtime = (os.environ if env is None else env).get(names.RUNTIME_DIR_ENV) or "/tmp"
        return str(Path(runtime) / f"kvtier-{self.shm_name}.sock")

    def peer_secret(self) -> bytes:
        """The shared peer secret, read from the mounted file (surrounding whitespace
        dropped). PeerSecretError, saying what to fix, when no file is configured, it
        cannot be read, or it is empty or short: the peer tier never starts without one."""
        if not self.peer_secret_file:
            raise PeerSecretError(
                "the peer tier is on (peer_enabled) but peer_secret_file is not set: mount the policy's "
                "peer Secret and set peer_secret_file (env KVTIER_PEER_SECRET_FILE) to its file, "
                "or set peer_enabled: false")
        try:
            secret = Path(self.peer_secret_file).read_bytes().strip()
        except OSError as exc:
            raise PeerSecretError(f"peer_secret_file {self.peer_secret_file} cannot be read "
                                  f"({exc.strerror or exc}): mount the policy's peer Secret there, "
                                  f"or set peer_enabled: false") from None
        return check_peer_secret(secret, f"file {self.peer_secret_file}")


ENV_OVERRIDES: dict[str, tuple[str, ...]] = {
    names.POD_NAME_ENV: ("pod_name",),
    names.POD_NAMESPACE_ENV: ("pod_namespace",),
    names.POD_IP_ENV: ("pod_ip",),
    names.WEIGHTS_VERSION_ENV: ("model", "weights_version"),
    names.REDIS_URL_ENV: ("redis_url",),
    # The webhook injects the operator's identity: who may call the control API.
    # The mounted peer Secret's file (named in the pod, where a runtime maps its path).
    names.PEER_SECRET_FILE_ENV: ("peer_secret_file",),
    names.CONTROL_AUTH_MODE_ENV: ("control_auth", "mode"),
    names.CONTROL_AUTH_USERS_ENV: ("control_auth", "allowed_users"),
    names.CONTROL_AUTH_AUDIENCE_ENV: ("control_auth", "audience"),
    names.CONTROL_AUTH_PROTECT_METRICS_ENV: ("control_auth", "protect_metrics"),
    names.CONTROL_AUTH_METRICS_USERS_ENV: ("control_auth", "metrics_users"),
    names.CONTROL_AUTH_TOKEN_FILE_ENV: ("control_auth", "token_file"),
    names.CONTROL_AUTH_CA_FILE_ENV: ("control_auth", "ca_file"),
    names.CONTROL_TLS_CERT_FILE_ENV: ("control_tls", "cert_file"),
    names.CONTROL_TLS_KEY_FILE_ENV: ("control_tls", "key_file"),
    names.CONTROL_TLS_PLAIN_HTTP_ENV: ("control_tls", "plain_http"),
}
# Environment variables holding a comma-separated list.
LIST_ENV = frozenset({names.CONTROL_AUTH_USERS_ENV, names.CONTROL_AUTH_METRICS_USERS_ENV})


def from_mapping(data: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> SidecarConfig:
    """Validate a parsed file, with downward-API environment variables applied on top."""
    merged: dict[str, Any] = json.loads(json.dumps(dict(data or {})))
    for var, path in ENV_OVERRIDES.items():
        value = (env or {}).get(var)
        if not value:
            continue
        node = merged
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = [v.strip() for v in value.split(",") if v.strip()] if var in LIST_ENV else value
    return SidecarConfig.model_validate(merged)


def parse_text(text: str) -> dict[str, Any]:
    import yaml

    data = yaml.safe_load(text) if text.strip() else {}
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError("sidecar config must be a mapping of field names to values")
    return data


def load(path: str | os.PathLike[str] | None, env: Mapping[str, str] | None = None) -> SidecarConfig:
    """Read and validate the config file (None: defaults), environment applied on top."""
    data = parse_text(Path(path).read_text()) if path else {}
    return from_mapping(data, os.environ if env is None else env)


def reload_diff(old: SidecarConfig, new: SidecarConfig) -> tuple[dict[str, Any], list[str]]:
    """Split the fields that changed into (applicable now, needing a restart)."""
    applicable: dict[str, Any] = {}
    restart: list[str] = []
    for name in SidecarConfig.model_fields:
        before, after = getattr(old, name), getattr(new, name)
        if before == after:
            continue
        if name in RELOADABLE_FIELDS:
            applicable[name] = after
        else:
            restart.append(name)
    return applicable, restart


def dump_yaml(config: SidecarConfig) -> str:
    """The file the operator writes into the ConfigMap."""
    import yaml

    return yaml.safe_dump(config.model_dump(mode="json", exclude={"pod_name", "pod_namespace", "pod_ip"}), sort_keys=False)
