"""`KvtierConnector`: vLLM's KV connector (V1) on kvtier's sidecar.

Scheduler side: one sidecar lookup per new request; the hit's tokens beyond vLLM's
local prefix hit are offered to vLLM, and the pinned arena slots travel to the
workers in the step's metadata (`plan`). Worker side: loads copy block runs from the
shared-memory arena into the paged KV tensors — layer by layer on a thread while the
forward pass runs (`layer_loads`; each attention layer waits for its own KV), once a
pass has shown that vLLM asks before every layer, and before the pass until then;
stores copy a finished prompt's full blocks into slots the sidecar reserved and commit
them (`layouts` does the layout mapping).

Every fault is a miss or a recompute, never an exception on the request path and
never wrong KV: a sidecar that is absent, restarting or slow gives 0 external tokens;
a load that cannot be done, from another sidecar instance or (with verify_checksums)
failing its checksum, reports its blocks through `get_block_ids_with_load_errors`, so
vLLM (kv_load_failure_policy "recompute", checked at start-up) recomputes exactly those.
"""
from __future__ import annotations

import atexit
import logging
import re
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import torch
import xxhash
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvtier.names import is_warmup
from kvtier.keys import block_hashes
from kvtier_sidecar.client import SidecarClient
from kvtier_sidecar.engine_proto import MAX_REMOVED_PER_ANSWER

from .config import (
    SOCKET_ENV,
    ConfigError,
    EngineIdentity,
    check_block_sizes,
    parse_config,
    rope_config_hash,
    tenant_of,
    weights_mismatch,
)
from . import events
from .announced import Announced
from .layouts import LAYOUT_FORMATS, LayoutError, block_places, format_for_device, format_tag, kv_views, layout_for
from .layer_loads import LayerJob, LayerLoads
from .lookups import AsyncLookups, Breaker
from .worker_calls import Staged, WorkerCalls
from .paged import PagedKV
from .plan import LoadSpec, SchedulerBook, StepSpecs, StoreSpec, read_hint, root_from_fields
from .stats import KvtierConnectorStats, KvtierPromMetrics

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# Under "vllm": vLLM configures that logger (VLLM_CONFIGURE_LOGGING), so the connector
# logs where and how vLLM's own connectors do.
log = logging.getLogger("vllm.kvtier_vllm")

SCHEDULER_REPORTED = ("prompt_tokens", "local_hit_tokens", "lookup_timeouts", "breaker_trips")
"""Scheduler-side counts the sidecar's /metrics gets too (`engine_proto.EngineReport`)."""
RECOMPUTE_POLICY = "recompute"
"""The only kv_load_failure_policy under which a failed load costs a recompute, not the request."""
REMOVAL_POLL_S = 0.5
"""How often rank 0 reads the sidecar's removal log while it has announced blocks: a
router believes in an evicted block at most about this long (plus its own delay)."""
REMOVAL_READS_PER_POLL = 8
"""Answers of MAX_REMOVED_PER_ANSWER hashes one poll reads at most before the next step."""


class KvtierConnectorMetadata(KVConnectorMetadata):
    def __init__(self, specs: StepSpecs) -> None:
        self.specs = specs


def engine_identity(vllm_config: "VllmConfig", attn_impl_id: str | None, model_id: str | None,
                    weights_version: str) -> EngineIdentity:
    mc = vllm_config.model_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    kv_dtype = str(mc.dtype).removeprefix("torch.") if cache_dtype == "auto" else str(cache_dtype)
    device = vllm_config.device_config.device_type
    if attn_impl_id is None:
        backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
        attn_impl_id = f"vllm-{device}-{getattr(backend, 'name', backend) or 'auto'}"
    # The blocks' byte format is part of their name: never read in another format.
    attn_impl_id = format_tag(attn_impl_id, format_for_device(device))
    served = mc.served_model_name
    name = model_id or (served[0] if isinstance(served, (list, tuple)) else served) or mc.model
    return EngineIdentity(model_id=str(name), weights_version=weights_version, kv_dtype=kv_dtype,
                          rope_config_hash=rope_config_hash(mc.hf_config.to_dict()), attn_impl_id=attn_impl_id)


def _layer_index(name: str) -> int:
    found = re.findall(r"\.(\d+)\.", "." + name + ".")
    if not found:
        raise LayoutError(f"cannot tell the layer index of KV cache {name!r}")
    return int(found[0])


class KvtierConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        policy = getattr(ktc, "kv_load_failure_policy", RECOMPUTE_POLICY)
        if policy != RECOMPUTE_POLICY:
            raise ConfigError(f'KvtierConnector needs "kv_load_failure_policy": "{RECOMPUTE_POLICY}" in '
                              f"--kv-transfer-config (got {policy!r}): a failed load must cost a recompute, "
                              "not the request")
        self.cfg = parse_config(ktc.kv_connector_extra_config)
        self.vllm_block_size = vllm_config.cache_config.block_size
        self.block_size = self.cfg.block_size or self.vllm_block_size
        check_block_sizes(self.block_size, self.vllm_block_size)
        self.identity = engine_identity(vllm_config, self.cfg.attn_impl_id, self.cfg.model_id,
                                        self.cfg.weights_version)
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        self.num_layers = mc.get_num_layers(pc)
        self.total_kv_heads = mc.get_total_num_kv_heads()
        self.head_dim = mc.get_head_size()
        self.tp = pc.tensor_parallel_size
        if self.total_kv_heads % self.tp:
            raise ConfigError(f"{self.total_kv_heads} kv heads do not split over tensor parallel size {self.tp}; "
                              "KvtierConnector needs whole kv heads per rank")
        self.client = SidecarClient(self.cfg.socket, timeout_s=self.cfg.lookup_timeout_s)
        self.stats = KvtierConnectorStats()
        self.lookups: AsyncLookups | None = None
        self.book: SchedulerBook | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.breaker = Breaker(self.cfg.breaker_backoff_s, on_change=self._breaker_changed)
            self.lookups = AsyncLookups(self.client, self.cfg.lookup_budget_ms / 1000, self.breaker,
                                        refuse=lambda info: weights_mismatch(info, self.identity.weights_version,
                                                                             self.cfg.socket))
            self.book = SchedulerBook(self.lookups, self.block_size, self.vllm_block_size,
                                      self.cfg.verify_checksums)
        self._step_wait_s = self.cfg.lookup_wait_ms / 1000  # left for this scheduler step
        kv_events = getattr(vllm_config, "kv_events_config", None)
        self._events_on = bool(kv_events is not None and getattr(kv_events, "enable_kv_cache_events", False))
        self._outbox = events.Outbox()  # worker side: events the calls thread emitted
        self._announced = Announced()  # worker side (rank 0): blocks announced, to withdraw
        self._removals_read_at = 0.0  # when the calls thread last read the sidecar's removal log
        self._removals_queued = False
        self._gathered: events.KvtierKVEvents | None = None  # scheduler side: the workers' events
        self._breaker_seen = (0, 0)  # (trips, recoveries) already in the stats
        # worker side, set by register_kv_caches
        self.rank = 0
        self.paged: PagedKV | None = None
        self._load_errors: set[int] = set()
        self._layer_ids: dict[str, int] = {}  # vLLM's layer name -> index in self.paged.layers
        self._waited: set[int] = set()  # layers that asked for their load in this forward pass
        self._layerwise = False  # set once a pass showed every layer waits for its load
        self._layer_loads: tuple[LayerLoads, list, float] | None = None
        self._reports_refused = False  # a sidecar that does not know REPORT (an older release)
        self._unreported: dict[str, int] = {}  # load counts not yet sent to the sidecar
        self._calls: WorkerCalls | None = None  # the worker's sidecar calls, off the forward pass
        # (sidecar instance, its arena) the loads read; replaced whole by the calls thread
        self._mapped: tuple[str, Any] | None = None
        self._unmapped_logged = False
        self._refused_instance: str | None = None  # the sidecar instance refused for its weights
        self._bg_lock = threading.Lock()
        self._bg_counts: dict[str, float] = {}  # stats the calls thread counts, merged at collection
        log.info("KvtierConnector %s: socket %s, block size %d (vLLM %d), identity %s", role.name,
                 self.cfg.socket, self.block_size, self.vllm_block_size, self.identity.model_dump())

    # ==================================================================================
    # scheduler side
    # ==================================================================================

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        """None ("not known yet") while the request's lookup runs within its budget;
        vLLM asks again at its next step. Never waits longer than what is left of
        lookup_wait_ms for this step."""
        try:
            root = self.identity.root(tenant_of(getattr(request, "cache_salt", None), self.cfg))
            prompt = list(request.prompt_token_ids or [])
            if len(prompt) <= self.block_size:
                return 0, False
            started = time.perf_counter()
            params = getattr(request, "kv_transfer_params", None)
            n = self.book.matched(request.request_id, root, prompt, num_computed_tokens, self._step_wait_s,
                                  is_warmup(params), read_hint(params))
            self._step_wait_s = max(0.0, self._step_wait_s - (time.perf_counter() - started))
            if self._events_on and not self.book.described(request.request_id):
                self._describe(request, len(prompt))
            return n, False
        except Exception:  # never on the request path: a fault is a miss
            log.exception("kvtier lookup failed; serving without it")
            return 0, False

    def _describe(self, request: "Request", prompt_len: int) -> None:
        """vLLM's hashes of the blocks a store of this prompt would commit, for its event."""
        try:
            stored_tokens = prompt_len // self.block_size * self.block_size
            self.book.describe(request.request_id,
                               events.describe(request, stored_tokens // self.vllm_block_size, self.vllm_block_size))
        except Exception:  # an event is a hint: never a fault on the request path
            log.exception("kvtier: describing a request's blocks for its KV event failed")

    def update_connector_output(self, connector_output: Any) -> None:
        got = getattr(connector_output, "kv_cache_events", None)
        if not isinstance(got, events.KvtierKVEvents):
            return
        if self._gathered is None:
            self._gathered = events.KvtierKVEvents()
        self._gathered.add_events(got.get_all_events())

    def take_events(self):
        gathered, self._gathered = self._gathered, None
        if gathered is not None:
            yield from gathered.get_all_events()

    def _breaker_changed(self, tripped: bool, why: str) -> None:
        if tripped:
            log.warning("kvtier: not asking the sidecar at %s for %.1f s (%s): requests are served without "
                        "kvtier meanwhile, then it is probed again", self.cfg.socket, self.breaker.backoff_s, why)
        else:
            log.warning("kvtier: the sidecar at %s answers again (%s); lookups resume", self.cfg.socket, why)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        try:
            block_ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
            self.book.allocated(request.request_id, block_ids, num_external_tokens)
        except Exception:
            log.exception("kvtier: bookkeeping after allocation failed; the request loads nothing")
            self.book.finished(request.request_id)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        try:
            done = self._prefills_done(scheduler_output)
            specs = self.book.step_specs(done)
        except Exception:
            log.exception("kvtier: building step metadata failed; this step loads and stores nothing")
            specs = StepSpecs()
        self._step_wait_s = self.cfg.lookup_wait_ms / 1000
        self._take_scheduler_counts()
        return KvtierConnectorMetadata(specs)

    def _take_scheduler_counts(self) -> None:
        """This step's scheduler-side counts, into KVConnectorStats and (through the
        lookup thread) the sidecar's /metrics."""
        counts = {**self.book.take_counts(), **self.lookups.take_counts()}
        trips, recoveries = self.breaker.trips, self.breaker.recoveries
        counts["breaker_trips"] = trips - self._breaker_seen[0]
        counts["breaker_recoveries"] = recoveries - self._breaker_seen[1]
        self._breaker_seen = (trips, recoveries)
        for name, value in counts.items():
            self.stats.add(name, value)
        self.lookups.report({name: counts[name] for name in SCHEDULER_REPORTED if counts.get(name)})

    def _prefills_done(self, so: "SchedulerOutput") -> list[str]:
        done = []
        for new in so.scheduled_new_reqs:
            self.book.blocks_changed(new.req_id, new.block_ids[0], replace=True)
            plen = self.book.prompt_len(new.req_id)
            if plen is not None and new.num_computed_tokens + so.num_scheduled_tokens.get(new.req_id, 0) >= plen:
                done.append(new.req_id)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                self.book.blocks_changed(req_id, new_ids[0], replace=req_id in cached.resumed_req_ids)
            plen = self.book.prompt_len(req_id)
            start = cached.num_computed_tokens[i]
            if plen is not None and start < plen <= start + so.num_scheduled_tokens.get(req_id, 0):
                done.append(req_id)
        return done

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        try:
            self.book.finished(request.request_id)
        except Exception:
            log.exception("kvtier: releasing a request's pins failed")
        return False, None

    # ==================================================================================
    # worker side
    # ==================================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.rank = get_tensor_model_parallel_rank() if self.tp > 1 else 0
        backend = self._backend_name()
        local_heads = self.total_kv_heads // self.tp
        names = sorted(kv_caches, key=_layer_index)
        if len(names) != self.num_layers:
            raise LayoutError(f"vLLM registered {len(names)} KV caches for a {self.num_layers}-layer model")
        tensors = [kv_caches[name] for name in names]
        self._layer_ids = {name: i for i, name in enumerate(names)}
        kernel = self._cpu_kernel(backend, tensors[0])
        layout = layout_for(backend, tensors[0].shape, local_heads, self.head_dim, cpu_kernel=kernel)
        if any(tuple(t.shape) != tuple(tensors[0].shape) for t in tensors):
            raise LayoutError("vLLM's layers have KV caches of different shapes; KvtierConnector needs one shape")
        expected = format_for_device(self._vllm_config.device_config.device_type)
        if LAYOUT_FORMATS[layout] is not expected:
            raise LayoutError(f"layout {layout.value} stores blocks as {LAYOUT_FORMATS[layout].value}, but the key "
                              f"root names {expected.value} (from the device type); refusing to mix formats")
        page_tokens = kv_views(tensors[0], layout, self.head_dim)[0].shape[2]
        check_block_sizes(self.block_size, page_tokens)
        self.paged = PagedKV.from_tensors(tensors, layout, self.total_kv_heads, self.head_dim, self.block_size,
                                          self.vllm_block_size, self.tp, self.rank)
        if self.client.connect():
            problem = self._arena_mismatch()
            if problem:
                raise ConfigError(problem)
            if not self._weights_refused():
                self._mapped = (str(self.client.info.get("instance", "")), self.client.arena)
        else:
            self._unmapped_logged = True
            log.error("kvtier: the sidecar's engine socket %s does not answer; this engine serves WITHOUT kvtier "
                      "until it does (check kv_connector_extra_config.socket / %s against the sidecar's "
                      "engine_socket)", self.cfg.socket, SOCKET_ENV)
            self.stats.add("sidecar_unreachable", 1)
        self._calls = WorkerCalls(self.cfg.store_staging_mb << 20)
        # a worker that exits without shutdown() still hands over its queued stores
        atexit.register(self._calls.idle, self.cfg.lookup_timeout_s)
        log.info("KvtierConnector worker rank %d/%d: %d layers, backend %s (%s), layout %s, page %d tokens",
                 self.rank, self.tp, len(tensors), backend, kernel, layout.value, page_tokens)

    def _weights_refused(self) -> bool:
        """True (logged once per sidecar instance, counted) when the sidecar serves other
        weights than this engine: the engine then uses none of its blocks and stores
        nothing in it (the digest in the key root keeps the blocks apart anyway, but the
        sidecar would count this engine's traffic under the other version)."""
        problem = weights_mismatch(self.client.info, self.identity.weights_version, self.cfg.socket)
        if problem is None:
            return False
        instance = str(self.client.info.get("instance", ""))
        if self._refused_instance != instance:
            self._refused_instance = instance
            log.error("kvtier: %s", problem)
            self._bg_add("weights_version_mismatch", 1)
        return True

    def _cpu_kernel(self, backend: str, tensor: torch.Tensor) -> str | None:
        """vLLM's CPU attention kernel for this cache (it decides how K is packed)."""
        if backend != "CPU_ATTN":
            return None
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return _get_attn_isa(tensor.dtype, int(tensor.shape[2]), self.head_dim,
                             self._vllm_config.cache_config.cache_dtype)

    def _backend_name(self) -> str:
        try:
            from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backend

            return get_current_attn_backend(self._vllm_config).get_name()
        except Exception as exc:
            raise LayoutError(f"cannot tell vLLM's attention backend ({exc}); KvtierConnector needs it to "
                              "know the KV layout") from exc

    def _arena_mismatch(self) -> str | None:
        info = self.client.info
        want = list(self.paged.block_shape)
        itemsize = self.paged.itemsize
        if list(info.get("block_shape", [])) != want or info.get("dtype") != f"u{itemsize}":
            return (f"the kvtier sidecar's blocks are {info.get('block_shape')} of {info.get('dtype')} "
                    f"(layers, K|V, kv heads, block size {info.get('block_size')}, head dim) but this engine's are "
                    f"{want} of u{itemsize} (block size {self.block_size}); make the sidecar's model shape and "
                    "block_size match the served model")
        return None

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._finish_layer_loads()  # normally done at the end of the previous step
        meta = self._connector_metadata
        if not isinstance(meta, KvtierConnectorMetadata):
            return
        pipelined: list[tuple[LoadSpec, int, LayerJob]] = []
        for spec in meta.specs.loads:
            started = time.perf_counter()
            try:
                arena, n = self._verified(spec)
                if n and self._layerwise:
                    job = LayerJob(self._layer_copier(arena, spec, n), n)
                    pipelined.append((spec, n, job))
                    continue
                self.paged.copy(arena, spec.slots[:n], spec.block_ids, spec.first_block, to_paged=True)
            except Exception:
                log.exception("kvtier load failed; vLLM recomputes the blocks")
                n = 0
            self._account_load(spec, n, time.perf_counter() - started)
        if pipelined:
            self._layer_loads = (LayerLoads([job for _, _, job in pipelined], len(self.paged.layers)).start(),
                                 pipelined, time.perf_counter())
        else:
            self._report()

    def _verified(self, spec: LoadSpec) -> tuple[Any, int]:
        """The arena and how many leading blocks of the spec may be copied (0 when the
        pins went with another sidecar instance, or its arena is not mapped in time;
        up to the first failed checksum)."""
        arena = self._arena_of(spec.instance)
        if self.paged is None or arena is None:
            return None, 0  # the pins went with the sidecar that handed them out
        n = len(spec.slots)
        if spec.digests is not None:
            for j, (slot, digest) in enumerate(zip(spec.slots, spec.digests)):
                if xxhash.xxh3_64_intdigest(arena.slot_view(slot, 1)) != digest:
                    log.warning("kvtier block %d of request %s failed its checksum; recomputing from there",
                                spec.first_block + j, spec.req_id)
                    n = j
                    break
        return arena, n

    def _arena_of(self, instance: str) -> Any:
        """The mapped arena of sidecar `instance`. Pins from an instance this worker has
        not mapped (the sidecar restarted) wait at most the lookup budget for the calls
        thread to connect; the forward pass never waits on the socket itself."""
        mapped = self._mapped
        if mapped is not None and mapped[0] == instance:
            return mapped[1]
        done = threading.Event()
        if self._calls is None or not self._calls.submit(lambda: self._remap(instance, done)):
            return None
        done.wait(self.cfg.lookup_budget_ms / 1000)
        mapped = self._mapped
        return mapped[1] if mapped is not None and mapped[0] == instance else None

    def _remap(self, instance: str, done: threading.Event) -> None:
        """On the calls thread: connect to the sidecar now serving (dropping a connection
        to an older instance) and map its arena."""
        try:
            if self.client.info.get("instance") != instance:
                self.client.close()
            self._refresh_mapping()
        finally:
            done.set()

    def _refresh_mapping(self) -> None:
        """On the calls thread: what the client is connected to now, for the loads."""
        if not self.client.connect():
            self._mapped = None  # the gone sidecar's arena: unmapped once in-flight loads end
            if not self._unmapped_logged:
                self._unmapped_logged = True
                log.error("kvtier: the sidecar's engine socket %s does not answer; loads and stores are "
                          "skipped until it does", self.cfg.socket)
            self._bg_add("sidecar_unreachable", 1)
            return
        problem = self._arena_mismatch()
        if problem:
            log.error("kvtier: %s; serving without it", problem)
            self._mapped = None
            return
        if self._weights_refused():
            self._mapped = None
            return
        if self._unmapped_logged:
            self._unmapped_logged = False
            log.warning("kvtier: the sidecar at %s answers again", self.cfg.socket)
        self._mapped = (str(self.client.info.get("instance", "")), self.client.arena)

    def _layer_copier(self, arena: Any, spec: LoadSpec, n: int) -> Callable[[int], None]:
        paged, slots = self.paged, spec.slots[:n]
        return lambda layer: paged.copy(arena, slots, spec.block_ids, spec.first_block, True, (layer,))

    def _account_load(self, spec: LoadSpec, loaded: int, seconds: float) -> None:
        """Stats for one request's load; the blocks not loaded go to vLLM as load errors."""
        self.stats.add("load_seconds", seconds)
        self.stats.add("loaded_blocks", loaded)
        counts = {}
        mapped = self._mapped
        if loaded and mapped is not None:
            counts["loaded_bytes"] = loaded * mapped[1].block_bytes // self.tp
            if self.rank == 0 and spec.warmup:  # the rollout's warm-up: no hit of traffic
                self.stats.add("warmup_loaded_tokens", loaded * self.block_size)
            elif self.rank == 0:  # tokens once per engine, not once per TP rank
                for tier, blocks in spec.blocks_by_tier(loaded).items():
                    if blocks:
                        counts[f"loaded_tokens_{tier}"] = blocks * self.block_size
        if loaded < len(spec.slots):
            failed = block_places(spec.block_ids, spec.first_block + loaded, len(spec.slots) - loaded,
                                  self.block_size, self.vllm_block_size, self.vllm_block_size)
            self._load_errors.update(page for page, _ in failed)
            counts["load_errors"] = len(spec.slots) - loaded
        for name, value in counts.items():
            self.stats.add(name, value)
            self._unreported[name] = self._unreported.get(name, 0) + value

    def _finish_layer_loads(self) -> None:
        """Wait for the step's layer-by-layer loads; account them like synchronous ones."""
        if self._layer_loads is None:
            return
        loads, pipelined, started = self._layer_loads
        self._layer_loads = None
        loads.finish()
        seconds = time.perf_counter() - started
        for spec, n, job in pipelined:
            self._account_load(spec, 0 if job.failed else n, seconds / len(pipelined))
        self._report()

    def _report(self) -> None:
        """The counts the loads added to KVConnectorStats since the last report, to the
        sidecar's /metrics (engine socket REPORT), sent by the calls thread. Best effort:
        a sidecar that is away misses them, and one that refuses them is not asked again."""
        counts, self._unreported = {k: int(v) for k, v in self._unreported.items() if v}, {}
        if self._reports_refused or self._calls is None or not counts:
            return
        self._calls.submit(lambda: self._send_report(counts))

    def _send_report(self, counts: dict[str, int]) -> None:
        try:
            self.client.report(**counts)
        except ValueError as exc:
            self._reports_refused = True
            log.warning("kvtier: the sidecar refused the load report (%s); not reporting again", exc)
        self._refresh_mapping_if_changed()

    def _refresh_mapping_if_changed(self) -> None:
        mapped = self._mapped
        if mapped is None or mapped[0] != self.client.info.get("instance") or mapped[1] is not self.client.arena:
            self._refresh_mapping()

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_ids.get(layer_name)
        if layer is None:
            return
        self._waited.add(layer)
        if self._layer_loads is not None:
            self._layer_loads[0].wait(layer)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return  # stores run in wait_for_save, once every layer holds the step's KV

    def wait_for_save(self) -> None:
        self._finish_layer_loads()
        if not self._layerwise and self.paged is not None and len(self._waited) == len(self.paged.layers):
            # every layer asked for its KV before reading it: loads may overlap the pass
            self._layerwise = True
            log.info("kvtier: every layer waits for its load; loads now overlap the forward pass layer by layer")
        self._waited.clear()
        meta = self._connector_metadata
        if not isinstance(meta, KvtierConnectorMetadata):
            return
        for spec in meta.specs.stores:
            try:
                self._store(spec)
            except Exception:
                log.exception("kvtier store failed; the blocks stay uncached")

    def _store(self, spec: StoreSpec) -> None:
        """Copy the prompt's blocks out of vLLM's pages now (they may be reused after this
        step), and leave the sidecar's part to the calls thread."""
        mapped = self._mapped
        if self.paged is None or self._calls is None:
            return
        if mapped is None:  # not connected: try again in the background, skip this store
            self._calls.submit(self._refresh_mapping_if_changed)
            self.stats.add("stores_skipped", 1)
            return
        n = len(spec.token_ids) // self.block_size
        staged = self._calls.stage(n, mapped[1].block_bytes)
        if staged is None:
            self.stats.add("stores_skipped", 1)  # the sidecar is far behind: staging is full
            return
        self.paged.copy(staged, list(range(n)), spec.block_ids, 0, to_paged=False)
        if not self._calls.submit_store(lambda: self._commit_staged(spec, staged), staged):
            self.stats.add("stores_skipped", 1)

    def _commit_staged(self, spec: StoreSpec, staged: Staged) -> None:
        """On the calls thread: reserve slots for the blocks the sidecar lacks, copy them
        from the staging buffer, commit."""
        res = self.client.begin_store(root_from_fields(spec.root), spec.token_ids, self.tp, self.rank)
        self._refresh_mapping_if_changed()
        if res is None:  # nothing to write because the sidecar holds it all is no refusal
            cached = getattr(self.client, "last_store_cached", False)
            self._bg_add("store_cached" if cached else "store_declined", 1)
            if cached:
                self._announce(spec)
            return
        try:
            self.paged.copy_blocks(staged, res.arena, range(res.first_block, res.first_block + len(res.slots)),
                                   res.slots)
        except Exception:
            self.client.abort_store(res)
            raise
        if self.client.commit_store(res):
            self._bg_add("saved_blocks", len(res.slots))
            self._bg_add("saved_bytes", len(res.slots) * res.arena.block_bytes // self.tp)
            self._announce(spec)

    def _announce(self, spec: StoreSpec) -> None:
        """On the calls thread: a BlockStored for the prompt's blocks the sidecar now
        holds (rank 0 speaks for all), tracked so that their removal is told too."""
        if spec.event is None or self.rank != 0:
            return
        medium = self.cfg.kv_events_medium
        self._outbox.put(events.stored(spec.event, spec.token_ids, self.vllm_block_size, medium))
        position = self.client.last_store_removals
        if position is None:  # a sidecar without a removal log: nothing to read removals from
            return
        kv_hashes = block_hashes(root_from_fields(spec.root), spec.token_ids, self.block_size)
        self._withdraw(self._announced.add(str(self.client.info.get("instance", "")), position, kv_hashes,
                                           spec.event["block_hashes"], self.vllm_block_size // self.block_size))

    def _withdraw(self, vllm_hashes: list[Any]) -> None:
        if vllm_hashes:
            self._outbox.put(events.removed(list(dict.fromkeys(vllm_hashes)), self.cfg.kv_events_medium))

    def _read_removals(self) -> None:
        """On the calls thread: the sidecar's block removals since the last read, as
        BlockRemoved for those announced; every announced block when the sidecar is
        another process now or its log cannot name them all."""
        self._removals_read_at, self._removals_queued = time.monotonic(), False
        ann = self._announced
        for _ in range(REMOVAL_READS_PER_POLL):
            if not len(ann) or ann.cursor is None:
                return
            try:
                got = self.client.removed_since(ann.cursor)
            except ValueError:  # refused (a sidecar without the log): read nothing, withdraw nothing
                log.debug("kvtier: the sidecar's removal log cannot be read", exc_info=True)
                return
            if str(self.client.info.get("instance", "")) != ann.instance:
                self._withdraw(ann.clear())  # restarted: its DRAM tier holds none of them
                return
            if got is None:
                return
            nxt, hashes = got
            if hashes is None:
                self._withdraw(ann.clear())
                ann.cursor = nxt
                return
            self._withdraw(ann.removed(ann.cursor, hashes))
            ann.cursor = nxt
            if len(hashes) < MAX_REMOVED_PER_ANSWER:
                return

    def get_kv_connector_kv_cache_events(self) -> events.KvtierKVEvents | None:
        if (len(self._announced) and not self._removals_queued and self._calls is not None
                and time.monotonic() - self._removals_read_at >= REMOVAL_POLL_S):
            self._removals_queued = self._calls.submit(self._read_removals)
        return self._outbox.take()

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_layer_loads()
        failed, self._load_errors = self._load_errors, set()
        return failed

    # ==================================================================================
    # both
    # ==================================================================================

    def _bg_add(self, name: str, value: float) -> None:
        with self._bg_lock:
            self._bg_counts[name] = self._bg_counts.get(name, 0) + value

    def get_kv_connector_stats(self) -> KvtierConnectorStats | None:
        with self._bg_lock:
            counts, self._bg_counts = self._bg_counts, {}
        for name, value in counts.items():
            self.stats.add(name, value)
        if self.stats.is_empty():
            return None
        out = KvtierConnectorStats(data=dict(self.stats.data))
        self.stats.reset()
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtierConnectorStats:
        return KvtierConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvtierPromMetrics:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        self._finish_layer_loads()
        if self._calls is not None:  # the last stores and reports, unless the sidecar is away
            self._calls.idle(self.cfg.lookup_timeout_s)
        for background in (self.lookups, self._calls):
            if background is not None:
                background.close()
        self.client.close()
