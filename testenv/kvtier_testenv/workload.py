"""A multi-tenant prompt workload and the engine loop that replays it through a sidecar.

`replay` is what an engine process does per request: lookup -> materialize the hit
-> (prefill the rest) -> store -> release, with every hit's bytes checked against a
recompute of the prefix. It counts, never raises: a wrong byte is `wrong_kv`, an
exception out of the client is `errors`; both must stay zero under every fault.
"""
from __future__ import annotations

import os
import random
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from kvtier.keys import KeyRoot
from kvtier.sidecar_config import ServedModel

from kvtier_sidecar.client import EngineHit, SidecarClient
from . import engine_io
from .synthetic import prefill_kv

# Vocabulary for generated prompts (any uint32 works; small ids read well in logs).
VOCAB = 32_000


class SyntheticOracle:
    """KV as a pure function of the chained block hashes (fast; `synthetic`)."""

    name = "synthetic"

    def __init__(self, block_size: int = 16, layers: int = 2, kv_heads: int = 2, head_dim: int = 16,
                 dtype_bytes: int = 4, weights_version: str = "dev") -> None:
        self.block_size = block_size
        model = ServedModel(model_id="reference-tiny", weights_version=weights_version, layers=layers,
                            kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes,
                            kv_dtype="float32", rope_config_hash="rope-default", attn_impl_id="sdpa")
        self.shape = model.model_dump(exclude_none=True)  # the sidecar config's `model`
        self.block_bytes = model.kv_bytes_per_token() * block_size
        self.vocab = VOCAB

    def root(self, tenant: str) -> KeyRoot:
        return ServedModel.model_validate(self.shape).root(tenant)

    def kv(self, root: KeyRoot, tokens: np.ndarray) -> np.ndarray:
        return prefill_kv(root, tokens, self.block_size, self.block_bytes)

    def same_kv(self, got: np.ndarray, expected: np.ndarray) -> bool:
        return np.array_equal(got, expected)


class ReferenceOracle:
    """KV from the numpy reference transformer's prefill (`kvtier_app.reference_transformer`)."""

    name = "reference"

    def __init__(self, block_size: int = 16, **model_kwargs) -> None:
        from kvtier_app.reference_transformer import TransformerConfig, ReferenceTransformer

        self.model = ReferenceTransformer(TransformerConfig(**model_kwargs))
        c = self.model.config
        self.block_size = block_size
        kv_shape = c.kv_shape(block_size)
        probe = self.model.key_root("probe")
        self.shape = ServedModel(**probe.identity().model_dump(), layers=c.layers, kv_heads=c.kv_heads,
                                 head_dim=c.head_dim, dtype_bytes=kv_shape.np_dtype.itemsize,
                                 ).model_dump(exclude_none=True)
        self.block_bytes = kv_shape.block_bytes
        self.vocab = c.vocab

    def root(self, tenant: str) -> KeyRoot:
        return self.model.key_root(tenant)

    def same_kv(self, got: np.ndarray, expected: np.ndarray) -> bool:
        """Equal up to fp32 rounding: prefill over a longer prompt batches the matmuls
        differently, so K/V of the same prefix differ in the last bits (~1e-6), while
        KV of any other prefix differs at O(1)."""
        if got.shape != expected.shape:
            return False
        dtype = np.dtype(f"f{self.shape['dtype_bytes']}")
        return bool(np.allclose(got.view(dtype), expected.view(dtype), rtol=1e-4, atol=1e-5))

    def continuation_ok(self, tokens: np.ndarray, hit_kv: np.ndarray, matched_tokens: int) -> bool:
        """The engine's view: logits computed on top of the hit's KV equal a full
        recompute's logits for the same positions (to fp32 rounding)."""
        past = self.model.past_from_blocks(hit_kv, self.block_size)
        cached = self.model.prefill(tokens, past=past).logits
        full = self.model.prefill(tokens).logits[matched_tokens:]
        return bool(np.allclose(cached, full, rtol=1e-3, atol=1e-4))

    def kv(self, root: KeyRoot, tokens: np.ndarray) -> np.ndarray:
        n = len(tokens) // self.block_size
        if n == 0:
            return np.zeros(0, dtype=np.uint8)
        result = self.model.prefill(tokens[: n * self.block_size])
        return np.ascontiguousarray(self.model.kv_blocks(result, self.block_size)).reshape(-1).view(np.uint8)


def make_oracle(kind: str, block_size: int = 16):
    if kind == "synthetic":
        return SyntheticOracle(block_size)
    if kind == "reference":
        return ReferenceOracle(block_size)
    raise ValueError(f"unknown KV oracle {kind!r}: use 'synthetic' or 'reference'")


@dataclass(slots=True)
class Request:
    tenant: str
    tokens: list[int]


@dataclass(slots=True)
class ReplayStats:
    requests: int = 0
    hits: dict[str, int] = field(default_factory=dict)
    hit_tokens: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    bytes_materialized: int = 0
    stores: int = 0
    wrong_kv: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    lookup_s: list[float] = field(default_factory=list)

    def merge(self, other: "ReplayStats") -> None:
        self.requests += other.requests
        for k, v in other.hits.items():
            self.hits[k] = self.hits.get(k, 0) + v
        for k, v in other.hit_tokens.items():
            self.hit_tokens[k] = self.hit_tokens.get(k, 0) + v
        self.prompt_tokens += other.prompt_tokens
        self.bytes_materialized += other.bytes_materialized
        self.stores += other.stores
        self.wrong_kv += other.wrong_kv
        self.errors += other.errors
        self.error_samples = (self.error_samples + other.error_samples)[:10]
        self.lookup_s += other.lookup_s

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("lookup_s")
        return d


def make_workload(tenants: int, templates: int, requests: int, seed: int = 0, vocab: int = VOCAB,
                  template_tokens: tuple[int, int] = (64, 200), suffix_tokens: tuple[int, int] = (8, 40)) -> list[Request]:
    """Tenants re-send a few long templates (system prompts, documents) with short
    unique suffixes; popularity is skewed (Zipf-like) across tenants and templates."""
    rng = random.Random(seed)
    catalog = {
        f"tenant-{t}": [[rng.randrange(vocab) for _ in range(rng.randint(*template_tokens))] for _ in range(templates)]
        for t in range(tenants)
    }
    names = list(catalog)
    weights = [1.0 / (i + 1) for i in range(len(names))]
    out = []
    for _ in range(requests):
        tenant = rng.choices(names, weights)[0]
        tmpl = rng.choices(catalog[tenant], [1.0 / (i + 1) for i in range(templates)])[0]
        out.append(Request(tenant, tmpl + [rng.randrange(vocab) for _ in range(rng.randint(*suffix_tokens))]))
    return out


def replay(socket_path: str, requests: list[Request], oracle_kind: str = "synthetic", block_size: int = 16,
           deadline_s: float | None = None, loops: int = 1, stop_file: str | None = None) -> ReplayStats:
    """Replay `requests` (`loops` times, or until `deadline_s` on the monotonic clock);
    with `stop_file`, also stop as soon as that file exists (a caller that waits for
    an event rather than a time)."""
    oracle = make_oracle(oracle_kind, block_size)
    client = SidecarClient(socket_path)
    stats = ReplayStats()
    i = 0
    total = len(requests) * loops
    while (deadline_s is None and i < total) or (deadline_s is not None and time.monotonic() < deadline_s):
        if stop_file is not None and os.path.exists(stop_file):
            break
        req = requests[i % len(requests)]
        i += 1
        try:
            _one(client, req, oracle, stats)
        except Exception as exc:  # the point of the exercise: this must never happen
            stats.errors += 1
            if len(stats.error_samples) < 10:
                stats.error_samples.append(f"{exc.__class__.__name__}: {exc}")
    client.close()
    return stats


def _one(client: SidecarClient, req: Request, oracle, stats: ReplayStats) -> None:
    block_size, block_bytes = oracle.block_size, oracle.block_bytes
    root = oracle.root(req.tenant)
    tokens = np.asarray(req.tokens, dtype=np.uint32)
    stats.requests += 1
    stats.prompt_tokens += len(tokens)
    t0 = time.perf_counter()
    hit = client.lookup(root, tokens)
    stats.lookup_s.append(time.perf_counter() - t0)
    expected = oracle.kv(root, tokens)  # the recompute
    if isinstance(hit, EngineHit):
        try:
            dst = np.empty(len(hit.blocks) * block_bytes, dtype=np.uint8)
            n = client.materialize(hit, dst)
            stats.bytes_materialized += n
            if hit.matched_tokens != len(hit.blocks) * block_size or hit.matched_tokens >= len(tokens) \
                    or not oracle.same_kv(dst, expected[: len(dst)]) \
                    or (hasattr(oracle, "continuation_ok") and not oracle.continuation_ok(tokens, dst, hit.matched_tokens)):
                stats.wrong_kv += 1
            stats.hits[hit.tier] = stats.hits.get(hit.tier, 0) + 1
            stats.hit_tokens[hit.tier] = stats.hit_tokens.get(hit.tier, 0) + hit.matched_tokens
            engine_io.report(client, len(tokens), hit, len(hit.blocks), block_bytes)
        finally:
            client.release(hit)
    else:
        engine_io.report(client, len(tokens))
    if len(expected) and client.store(root, tokens, expected):
        stats.stores += 1
