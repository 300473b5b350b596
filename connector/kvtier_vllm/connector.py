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

import logging
import re
import time
from typing import TYPE_CHECKING, Any, Callable

import torch
import xxhash
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvtier_sidecar.client import SidecarClient

from .config import (
    ConfigError,
    EngineIdentity,
    check_block_sizes,
    parse_config,
    rope_config_hash,
    tenant_of,
)
from .layouts import LAYOUT_FORMATS, LayoutError, block_places, format_for_device, format_tag, kv_views, layout_for
from .layer_loads import LayerJob, LayerLoads
from .paged import PagedKV
from .plan import LoadSpec, SchedulerBook, StepSpecs, StoreSpec, root_from_fields
from .stats import KvtierConnectorStats

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

RECOMPUTE_POLICY = "recompute"
"""The only kv_load_failure_policy under which a failed load costs a recompute, not the request."""


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
        self.book = SchedulerBook(self.client, self.block_size, self.vllm_block_size, self.cfg.verify_checksums)
        # worker side, set by register_kv_caches
        self.rank = 0
        self.paged: PagedKV | None = None
        self._load_errors: set[int] = set()
        self._layer_ids: dict[str, int] = {}  # vLLM's layer name -> index in self.paged.layers
        self._waited: set[int] = set()  # layers that asked for their load in this forward pass
        self._layerwise = False  # set once a pass showed every layer waits for its load
        self._layer_loads: tuple[LayerLoads, list, float, tuple[int, int]] | None = None
        self._reports_refused = False  # a sidecar that does not know REPORT (an older release)
        log.info("KvtierConnector %s: socket %s, block size %d (vLLM %d), identity %s", role.name,
                 self.cfg.socket, self.block_size, self.vllm_block_size, self.identity.model_dump())

    # ==================================================================================
    # scheduler side
    # ==================================================================================

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        try:
            root = self.identity.root(tenant_of(getattr(request, "cache_salt", None), self.cfg))
            prompt = list(request.prompt_token_ids or [])
            if len(prompt) <= self.block_size:
                return 0, False
            return self.book.matched(request.request_id, root, prompt, num_computed_tokens), False
        except Exception:  # never on the request path: a fault is a miss
            log.exception("kvtier lookup failed; serving without it")
            return 0, False

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
        lookups, hit_tokens = self.book.take_counts()
        self.stats.add("lookups", lookups)
        self.stats.add("hit_tokens", hit_tokens)
        return KvtierConnectorMetadata(specs)

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
        else:
            log.warning("kvtier sidecar at %s not reachable yet; serving without it until it is", self.cfg.socket)
        log.info("KvtierConnector worker rank %d/%d: %d layers, backend %s (%s), layout %s, page %d tokens",
                 self.rank, self.tp, len(tensors), backend, kernel, layout.value, page_tokens)

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
        before = self.stats.data["loaded_bytes"], self.stats.data["load_errors"]
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
                                 pipelined, time.perf_counter(), before)
        else:
            self._report(self.stats.data["loaded_bytes"] - before[0], self.stats.data["load_errors"] - before[1])

    def _verified(self, spec: LoadSpec) -> tuple[Any, int]:
        """The arena and how many leading blocks of the spec may be copied (0 when the
        pins went with another sidecar instance; up to the first failed checksum)."""
        self.client.connect()
        if self.paged is None or self.client.info.get("instance") != spec.instance or self._arena_mismatch():
            return None, 0  # the pins went with the sidecar that handed them out
        arena = self.client.arena
        n = len(spec.slots)
        if spec.digests is not None:
            for j, (slot, digest) in enumerate(zip(spec.slots, spec.digests)):
                if xxhash.xxh3_64_intdigest(arena.slot_view(slot, 1)) != digest:
                    log.warning("kvtier block %d of request %s failed its checksum; recomputing from there",
                                spec.first_block + j, spec.req_id)
                    n = j
                    break
        return arena, n

    def _layer_copier(self, arena: Any, spec: LoadSpec, n: int) -> Callable[[int], None]:
        paged, slots = self.paged, spec.slots[:n]
        return lambda layer: paged.copy(arena, slots, spec.block_ids, spec.first_block, True, (layer,))

    def _account_load(self, spec: LoadSpec, loaded: int, seconds: float) -> None:
        """Stats for one request's load; the blocks not loaded go to vLLM as load errors."""
        self.stats.add("load_seconds", seconds)
        self.stats.add("loaded_blocks", loaded)
        if loaded and self.client.arena is not None:
            self.stats.add("loaded_bytes", loaded * self.client.arena.block_bytes // self.tp)
        if loaded < len(spec.slots):
            failed = block_places(spec.block_ids, spec.first_block + loaded, len(spec.slots) - loaded,
                                  self.block_size, self.vllm_block_size, self.vllm_block_size)
            self._load_errors.update(page for page, _ in failed)
            self.stats.add("load_errors", len(spec.slots) - loaded)

    def _finish_layer_loads(self) -> None:
        """Wait for the step's layer-by-layer loads; account them like synchronous ones."""
        if self._layer_loads is None:
            return
        loads, pipelined, started, before = self._layer_loads
        self._layer_loads = None
        loads.finish()
        seconds = time.perf_counter() - started
        for spec, n, job in pipelined:
            self._account_load(spec, 0 if job.failed else n, seconds / len(pipelined))
        self._report(self.stats.data["loaded_bytes"] - before[0], self.stats.data["load_errors"] - before[1])

    def _report(self, loaded_bytes: int, load_errors: int) -> None:
        """The same counts this step added to KVConnectorStats, to the sidecar's /metrics
        (engine socket REPORT). Best effort: a sidecar that is away misses them, and one
        that refuses them is not asked again."""
        if self._reports_refused:
            return
        try:
            self.client.report(loaded_bytes, load_errors)
        except ValueError as exc:
            self._reports_refused = True
            log.warning("kvtier: the sidecar refused the load report (%s); not reporting again", exc)
        except Exception:  # a report is never worth failing the forward pass for
            log.warning("kvtier: load report failed", exc_info=True)

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
        if self.paged is None or not self.client.connect() or self._arena_mismatch():
            return
        res = self.client.begin_store(root_from_fields(spec.root), spec.token_ids, self.tp, self.rank)
        if res is None:
            self.stats.add("store_declined", 1)
            return
        try:
            self.paged.copy(res.arena, res.slots, spec.block_ids, res.first_block, to_paged=False)
        except Exception:
            self.client.abort_store(res)
            raise
        if self.client.commit_store(res):
            self.stats.add("saved_blocks", len(res.slots))
            self.stats.add("saved_bytes", len(res.slots) * res.arena.block_bytes // self.tp)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_layer_loads()
        failed, self._load_errors = self._load_errors, set()
        return failed

    # ==================================================================================
    # both
    # ==================================================================================

    def get_kv_connector_stats(self) -> KvtierConnectorStats | None:
        if self.stats.is_empty():
            return None
        out = KvtierConnectorStats(data=dict(self.stats.data))
        self.stats.reset()
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtierConnectorStats:
        return KvtierConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        self._finish_layer_loads()
        self.client.close()
