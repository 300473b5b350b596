"""The sidecar's HTTP control API as types: what the sidecar serves and the operator
reads, defined once so the two cannot drift apart. `ROUTES` is the one table of it (the
sidecar registers its handlers from it; the operator, testenv and the demos build their
URLs from it; no path is spelled anywhere else):

    GET  /cache/stats?tenant=T   -> TenantStats (a tenant) | SidecarStats (no tenant)
    POST /cache/invalidate       InvalidateRequest -> 202 InvalidateAccepted
    POST /cache/warm             WarmRequest       -> 202 WarmAccepted (409 ErrorBody: peer tier off)
    POST /cache/drain/done       -> 202 DrainDone (409 ErrorBody: not draining)
    GET  /cache/hot?tenant=T&max_tokens=N -> HotPrompts: T's hottest prefixes' token ids
    GET  /cache/jobs             -> Jobs: {job id: Job}
    GET  /metrics                -> Prometheus text
    GET  /healthz                -> Health
    GET  /readyz                 -> Readiness (503 when not ready)
    any 4xx/5xx                  -> ErrorBody

Requests are strict (an unknown field is a 422 naming it). Answers are built strictly
and read tolerantly: the constructor refuses a field the model lacks (so nothing the
sidecar computes is dropped on the way out), `model_validate` ignores one (during an
upgrade an older operator reads a newer sidecar's stats).
"""
from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal, NewType

from pydantic import (BaseModel, ConfigDict, Field, RootModel, StrictInt, ValidationInfo, field_validator,
                      model_validator)

from kvtier.peer_address import parse_peer
from kvtier.sidecar_config import DEFAULT_CONTROL_AUDIENCE
from kvtier.tenants import TenantName

JobId = NewType("JobId", str)
# Longest tenant, model version or job ref the API takes: a name, not a payload.
MAX_NAME_CHARS = 256
# host:port, host a DNS name, IPv4 or bracketed IPv6.
# Largest warm-up one request may ask for: 4 TiB is beyond any node's DRAM tier, and a
# bound keeps a typo (10**30) a clear 422 instead of an integer no code path expects.
MAX_WARM_BYTES = 4 << 40
# Most tokens one `GET /cache/hot` answers with (about 8 MiB of JSON): a rollout's
# per-pod warm-up budget is far below it (`policy.MAX_ROLLOUT_WARM_TOKENS` per pod is
# split over the pod's tenants and asked per tenant).
MAX_HOT_TOKENS = 1 << 20


# The audience of the operator's token for one sidecar: its pod's own, so a token one
# sidecar received opens no other (the webhook writes the same formula into the pod,
# with the downward-API variables for the names; the operator mints per pod).
POD_AUDIENCE_TEMPLATE = "{base}:{namespace}:{pod}"


def pod_audience(namespace: str, pod: str, base: str = DEFAULT_CONTROL_AUDIENCE) -> str:
    return POD_AUDIENCE_TEMPLATE.format(base=base, namespace=namespace, pod=pod)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Validation context of an answer being read (`model_validate`): fields this version
# does not know are left out, in nested answers too.
_READING = {"control_api": "read"}


def _reading(info: ValidationInfo) -> bool:
    return isinstance(info.context, dict) and info.context.get("control_api") == _READING["control_api"]


class _ReadTolerantly:
    """`model_validate`/`model_validate_json` read in the `_READING` context unless
    given another."""

    @classmethod
    def model_validate(cls, obj: Any, *, context: Any = None, **kw: Any):
        return super().model_validate(obj, context=_READING if context is None else context, **kw)  # type: ignore[misc]

    @classmethod
    def model_validate_json(cls, json_data: Any, *, context: Any = None, **kw: Any):
        return super().model_validate_json(  # type: ignore[misc]
            json_data, context=_READING if context is None else context, **kw)


class _Answer(_ReadTolerantly, BaseModel):
    """An answer: `Answer(**fields)` refuses a field the model lacks (the sender's side:
    nothing computed is dropped), `Answer.model_validate(data)` ignores one (the
    reader's: a newer sender)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _known_fields_when_reading(cls, data: Any, info: ValidationInfo) -> Any:
        if _reading(info) and isinstance(data, dict):
            return {k: v for k, v in data.items() if k in cls.model_fields}
        return data


class InvalidateRequest(_Request):
    """Drop every block cached under `model_version` (a weights version)."""

    model_version: str = Field(min_length=1, max_length=MAX_NAME_CHARS)


class WarmRequest(_Request):
    """Pull `tenant`'s hottest prefixes, up to `max_bytes`, from the peer `from_peer`."""

    tenant: TenantName
    from_peer: str = Field(min_length=3, max_length=300)
    # Strict: true, "100" and 1.0 are refused rather than read as numbers.
    max_bytes: StrictInt = Field(gt=0, le=MAX_WARM_BYTES)
    # Idempotency key: the same ref with the same parameters answers the first job;
    # with different parameters it is a 409 (see Sidecar.warm).
    ref: str | None = Field(default=None, min_length=1, max_length=MAX_NAME_CHARS)

    @field_validator("from_peer")
    @classmethod
    def _host_port(cls, value: str) -> str:
        parse_peer(value)  # raises with what to fix: port 1..65535, an IP or a dotted name
        return value


class ErrorBody(_Answer):
    error: str


class InvalidateAccepted(_Answer):
    accepted: Literal[True] = True
    model_version: str
    job: JobId


class WarmAccepted(_Answer):
    accepted: Literal[True] = True
    job: JobId
    started: bool  # False: a known ref, answered with the job it started before


class DrainDone(_Answer):
    draining: Literal[True] = True
    done: Literal[True] = True


class JobKind(StrEnum):
    WARM = "warm"
    INVALIDATE = "invalidate"


class JobState(StrEnum):
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class Job(_Answer):
    """A background job; `started_s`/`finished_s` are wall-clock seconds."""

    kind: JobKind
    state: JobState = JobState.RUNNING
    started_s: float
    finished_s: float | None = None
    result: dict[str, int] | None = None
    bytes: int = 0
    error: str | None = None
    # What a warm-up was about (None for other kinds).
    tenant: str | None = None
    from_peer: str | None = None
    max_bytes: int | None = None
    ref: str | None = None
    asks: int = 0  # how many requests named this job (a remembered ref counts again)


class Jobs(_ReadTolerantly, RootModel[dict[JobId, Job]]):
    """`GET /cache/jobs`: every job kept, by id."""


class CacheReport(_Answer):
    """The core cache's figures on the wire (`kvtier.cache.CacheStats`, the internal
    snapshot, may change without changing this). Every field is required: the sidecar
    builds it from the snapshot, and a figure either side lacks is an error there."""

    tenant: str | None
    lookups: int
    hits: int
    misses: int
    hit_rate: float
    prompt_tokens: int
    matched_tokens: int
    token_hit_rate: float
    stored_blocks: int
    blocks_used: int
    bytes_used: int
    capacity_bytes: int
    evictions: int
    tier_hits: dict[str, int]
    pinned_bytes: int
    admission_bar: int
    min_sightings: int
    admission_admits: int
    admission_rejects: int
    window_blocks: int
    window_target_blocks: int
    main_blocks: int
    thrashing: bool
    thrash_events: int
    queue_depth: int
    queue_capacity: int
    queue_drops: int
    stores_enqueued: int
    stores_applied: int
    invalidated_blocks: int
    reserved_blocks: int


class TenantStats(_Answer):
    """`GET /cache/stats?tenant=T`: one tenant's lookups and hits (or the whole
    sidecar's, summed), and its share of the cache."""

    tenant: str | None = None
    lookups: int = 0
    hits: int = 0
    hit_rate: float = 0.0
    token_hit_rate: float = 0.0
    hits_by_tier: dict[str, int] = Field(default_factory=dict)
    hit_tokens_by_tier: dict[str, int] = Field(default_factory=dict)
    lookup_tokens: int = 0
    peer_bytes_fetched: int = 0
    stores: int = 0
    stores_declined: int = 0
    stores_cached: int = 0
    warmed_bytes: int = 0
    served_bytes_by_tier: dict[str, int] = Field(default_factory=dict)
    cache: CacheReport | None = None


class TenantSummary(_Answer):
    """One tenant in the whole-sidecar answer: bytes held here, lookups, hits."""

    bytes: int
    lookups: int
    hits: int
    warmed_bytes: int


class IndexState(_Answer):
    """The global index as this sidecar sees it. Reads and writes fail separately:
    `reads`/`writes` are `ok` or the failure that paused them (unreachable, oom,
    readonly, moved, error)."""

    enabled: bool
    available: bool | None = None  # lookups are attempted
    writable: bool | None = None  # registrations are attempted
    reads: str | None = None
    writes: str | None = None
    pending_blocks: int | None = None
    members: list[str] | None = None
    """The live members a lookup may fetch from: as of the last heartbeat, less any peer
    forgotten after a failed fetch until the next one."""
    counters: dict[str, int] = Field(default_factory=dict)


class NvmeReport(_Answer):
    """The NVMe shadow probe: the last measurement of the pod's local disk, if any."""

    mode: str
    path: str
    serving: bool = False
    samples: int = 0
    error: str | None = None
    measured_gbps: float | None = None
    write_gbps: float | None = None
    read_gbps: float | None = None
    nbytes: int | None = None
    direct_io: bool | None = None
    partial: bool | None = None
    elapsed_s: float | None = None
    measured_at_s: float | None = None


class EngineLoads(_Answer):
    """What the engines of this sidecar reported loading (engine socket REPORT): the
    hit figure the operator, the dashboard and the alerts read. `hit_rate` is loaded
    over prompt tokens; the lookups' `hits`/`hit_tokens_by_tier` are what the sidecar
    offered, which an engine may not take (its own prefix cache may hold it)."""

    loaded_tokens_by_tier: dict[str, int] = Field(default_factory=dict)
    local_hit_tokens: int = 0
    prompt_tokens: int = 0

    @property
    def loaded_tokens(self) -> int:
        return sum(self.loaded_tokens_by_tier.values())

    @property
    def hit_rate(self) -> float | None:
        return self.loaded_tokens / self.prompt_tokens if self.prompt_tokens else None


class SidecarStats(TenantStats):
    """`GET /cache/stats`: the whole sidecar, with the tenants holding the most bytes."""

    engine: EngineLoads = Field(default_factory=EngineLoads)

    sidecar: dict[str, int] = Field(default_factory=dict)
    index: IndexState = Field(default_factory=lambda: IndexState(enabled=False))
    tenants: dict[str, TenantSummary] = Field(default_factory=dict)
    tenants_total: int = 0
    peer_enabled: bool = False
    thrash_ratio: float | None = None
    draining: bool = False
    nvme: NvmeReport | None = None


class HotPrompt(_Answer):
    """One cached prefix: its token ids (whole blocks) and its decayed hit frequency."""

    token_ids: list[int]
    frequency: float


class HotPrompts(_Answer):
    """`GET /cache/hot`: one tenant's prefixes worth prefilling on a new engine, chosen
    by the decayed hit frequency of the blocks each adds (a template before one
    request's question) within `max_tokens` newly covered tokens, listed best first
    (frequency x length). Only the tenant asked for: another tenant's token ids are
    never in it."""

    tenant: str
    max_tokens: int
    tokens: int  # the token ids listed, all prefixes together
    prefixes: list[HotPrompt] = Field(default_factory=list)


class Health(_Answer):
    ok: Literal[True] = True


class Readiness(_Answer):
    ready: bool
    detail: str


def dump(answer: BaseModel) -> dict[str, Any]:
    """An answer as the JSON object the API sends."""
    return answer.model_dump(mode="json")


# -- the route table --------------------------------------------------------------------

# Under this prefix every path needs the operator's token (unknown ones too: a 401
# before a 404); /metrics does when the config protects it; the probes never do.
PROTECTED_PREFIX = "/cache/"


@dataclass(frozen=True, slots=True)
class Route:
    """One endpoint: `request` the body model (None: no body read), `response` the
    answer on `status` (None: not JSON: /metrics is Prometheus text)."""

    name: str
    method: Literal["GET", "POST"]
    path: str
    request: type[BaseModel] | None
    response: type[BaseModel] | None
    status: int = 200

    @property
    def protected(self) -> bool:
        return self.path.startswith(PROTECTED_PREFIX)

    def url(self, base: str = "", **query: str | None) -> str:
        """`base` + the path, with the query parameters that are not None."""
        given = {k: v for k, v in query.items() if v is not None}
        return base + self.path + (f"?{urllib.parse.urlencode(given)}" if given else "")


STATS = Route("stats", "GET", "/cache/stats", None, SidecarStats)  # ?tenant=T: TenantStats
INVALIDATE = Route("invalidate", "POST", "/cache/invalidate", InvalidateRequest, InvalidateAccepted, 202)
WARM = Route("warm", "POST", "/cache/warm", WarmRequest, WarmAccepted, 202)
DRAIN_DONE = Route("drain_done", "POST", "/cache/drain/done", None, DrainDone, 202)
JOBS = Route("jobs", "GET", "/cache/jobs", None, Jobs)
HOT = Route("hot", "GET", "/cache/hot", None, HotPrompts)  # ?tenant=T&max_tokens=N
METRICS = Route("metrics", "GET", "/metrics", None, None)
HEALTHZ = Route("healthz", "GET", "/healthz", None, Health)
READYZ = Route("readyz", "GET", "/readyz", None, Readiness)

ROUTES: tuple[Route, ...] = (STATS, INVALIDATE, WARM, DRAIN_DONE, JOBS, HOT, METRICS, HEALTHZ, READYZ)
