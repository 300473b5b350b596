"""Core library: lookup latency, hashing speed, materialize bandwidth, stores vs lookups.

Four figures, each measured in this run on this machine:

1. lookup of a 2,000-token prompt in an index holding >= 100k blocks against vLLM's
   own block hashing of the same prompt (chained sha256 over pickled (parent, tokens
   tuple, extras), 16-token blocks: what vLLM's prefix cache computes for every
   request), timed sample by sample in alternation: p50 <= 1x and p99 <= 1.5x
   (the whole lookup, hashing and index walk, costs less than the hashing alone of
   the engine it serves);
2. `block_hashes` over 2,000 tokens against chained sha256 over pickled
   (parent, tokens tuple, extras) tuples, the scheme vLLM uses: >= 5x;
3. `materialize` of a 2,000-token hit against one numpy copy of the same bytes:
   >= 0.7x the bandwidth (the hit's slots split into a few runs, as after churn);
4. lookup p99 during a burst of 10k stores against idle lookup p99, measured in
   alternating chunks so machine noise hits both alike: < 2x.
"""
from __future__ import annotations

import gc
import hashlib
import pickle
import statistics
import time

import numpy as np

from bench.common import Result, best_of, machine, percentile
from kvtier.cache import LocalCache
from kvtier.keys import KeyRoot, block_hashes

PROMPT_TOKENS = 2000
BLOCK = 16
# Targets, with the numbered list in the module docstring saying why each matters.
LOOKUP_P50_VS_VLLM_HASH = 1.0
LOOKUP_P99_VS_VLLM_HASH = 1.5
HASH_SPEEDUP = 5.0
MATERIALIZE_FRACTION = 0.7
BURST_P99_FACTOR = 2.0
MATERIALIZE_BLOCK_BYTES = 256 * 1024
"""A few hundred KiB per block: 16 tokens of a 4-layer slice of an 8B-class model
(8 kv heads x 128 dims x fp16 = 4 KiB per token per layer... x 4 layers x 16 tokens)."""


def _roots(n: int) -> list[KeyRoot]:
    return [KeyRoot(f"tenant-{i}", "llama-3-8b", "sha256:feedface", "fp16", "rope-500000", "flash-2")
            for i in range(n)]


def _populate(cache: LocalCache, roots: list[KeyRoot], prompts_per_root: int, rng: np.random.Generator,
              system_tokens: int = 512) -> list[tuple[KeyRoot, np.ndarray]]:
    """Each tenant: one system prompt shared by its prompts, then a unique document."""
    stored = []
    for root in roots:
        system = rng.integers(0, 128_000, system_tokens, dtype=np.uint32)
        for _ in range(prompts_per_root):
            doc = rng.integers(0, 128_000, PROMPT_TOKENS - system_tokens, dtype=np.uint32)
            tokens = np.concatenate([system, doc])
            res = cache.reserve(root, tokens, force=True)
            if res is not None:
                cache.commit(res)
            stored.append((root, tokens))
    return stored


def _lookup_samples(cache: LocalCache, prompts: list[tuple[KeyRoot, np.ndarray]], n: int,
                    rng: np.random.Generator) -> tuple[list[float], list[float]]:
    """(lookup seconds, vLLM-style hashing seconds) of the same prompts, alternating
    sample by sample so machine load falls on both alike. vLLM holds a request's
    tokens as a list; the sidecar receives them as an array."""
    ours, vllm = [], []
    picks = rng.integers(0, len(prompts), n)
    for i in picks:
        root, tokens = prompts[i]
        as_list, parent = tokens.tolist(), root.digest()
        t0 = time.perf_counter()
        hit = cache.lookup(root, tokens)
        t1 = time.perf_counter()
        _vllm_style_hashes(parent, as_list)
        t2 = time.perf_counter()
        ours.append(t1 - t0)
        vllm.append(t2 - t1)
        cache.release(hit)
    return ours, vllm


def bench_lookup(quick: bool) -> tuple[list[Result], LocalCache, list]:
    rng = np.random.default_rng(1)
    cache = LocalCache(200_000 * 64, 64, metadata_only=True, drain_budget_s=0)
    prompts = _populate(cache, _roots(40), 28, rng)   # 40 x (32 + 28 x 93) ~ 105k blocks
    blocks = cache.stats().blocks_used
    samples, vllm = _lookup_samples(cache, prompts, 2000 if quick else 10_000, rng)
    note = f"index holds {blocks:,} blocks; prompt {PROMPT_TOKENS} tokens as a uint32 array"
    base = "vLLM's block hashing of the same prompt"
    return [
        Result("lookup 2,000-token prompt, p50", percentile(samples, 0.5) * 1e6, "us", LOOKUP_P50_VS_VLLM_HASH,
               "lower", baseline=percentile(vllm, 0.5) * 1e6, baseline_name=f"{base}, p50", note=note),
        Result("lookup 2,000-token prompt, p99", percentile(samples, 0.99) * 1e6, "us", LOOKUP_P99_VS_VLLM_HASH,
               "lower", baseline=percentile(vllm, 0.99) * 1e6, baseline_name=f"{base}, p99", note=note),
    ], cache, prompts


def _vllm_style_hashes(parent: bytes, tokens: list[int]) -> list[bytes]:
    """vLLM's `hash_block_tokens` over a request with its default `sha256` hash
    (vllm.utils.hashing: sha256 of pickle.dumps(..., HIGHEST_PROTOCOL)), restated so
    this benchmark runs without vLLM installed."""
    out = []
    for i in range(0, len(tokens) - BLOCK + 1, BLOCK):
        data = pickle.dumps((parent, tuple(tokens[i:i + BLOCK]), None), protocol=pickle.HIGHEST_PROTOCOL)
        parent = hashlib.sha256(data).digest()
        out.append(parent)
    return out


def bench_hashing(quick: bool) -> list[Result]:
    root = _roots(1)[0]
    arr = np.random.default_rng(2).integers(0, 128_000, PROMPT_TOKENS, dtype=np.uint32)
    as_list = arr.tolist()
    number = 20 if quick else 100
    ours = best_of(lambda: block_hashes(root, arr), repeat=5, number=number)
    ours_list = best_of(lambda: block_hashes(root, as_list), repeat=5, number=number)
    theirs = best_of(lambda: _vllm_style_hashes(root.digest(), as_list), repeat=5, number=number)
    return [Result(
        "block_hashes 2,000 tokens vs chained sha256(pickle)", PROMPT_TOKENS / ours / 1e6, "Mtok/s",
        HASH_SPEEDUP, "higher", "ratio", baseline=PROMPT_TOKENS / theirs / 1e6,
        baseline_name="sha256 over pickled (parent, tuple, None) per block",
        note=f"ours {ours * 1e6:.1f} us (array in), {ours_list * 1e6:.1f} us (list in, "
             f"{theirs / ours_list:.1f}x); sha256-pickle {theirs * 1e6:.1f} us")]


def bench_materialize(quick: bool) -> list[Result]:
    bb = MATERIALIZE_BLOCK_BYTES
    n_blocks = PROMPT_TOKENS // BLOCK
    cache = LocalCache((n_blocks + 40) * bb, bb, drain_budget_s=0)
    rng = np.random.default_rng(3)
    root = _roots(1)[0]
    # Interleave short fillers with the prompt's stores so its slots form several runs.
    tokens = rng.integers(0, 128_000, PROMPT_TOKENS + 1, dtype=np.uint32)
    step = 25
    for end in range(step, n_blocks + 1, step):
        res = cache.reserve(root, tokens[:end * BLOCK], force=True)
        cache.arena[res.offsets[0]:res.offsets[-1] + bb] = 7
        cache.commit(res)
        filler = cache.reserve(_roots(2)[1], rng.integers(0, 9, 32, dtype=np.uint32), force=True)
        cache.commit(filler)
    hit = cache.lookup(root, tokens)
    runs = sum(1 for i in range(1, len(hit.blocks)) if hit.blocks[i] != hit.blocks[i - 1] + 1) + 1
    nbytes = len(hit.blocks) * bb
    dst = np.empty(nbytes, dtype=np.uint8)
    src = np.ones(nbytes, dtype=np.uint8)
    dst[:] = 0  # fault the pages in before timing either side
    base_s, ours_s = _alternating_best(lambda: np.copyto(dst, src), lambda: cache.materialize(hit, dst),
                                       repeat=10 if quick else 30)
    cache.release(hit)
    gbps = nbytes / ours_s / 1e9
    return [Result(
        "materialize 2,000-token hit vs numpy memcpy", gbps, "GB/s", MATERIALIZE_FRACTION, "higher", "ratio",
        baseline=nbytes / base_s / 1e9, baseline_name="np.copyto of the same bytes",
        note=f"{len(hit.blocks)} blocks x {bb // 1024} KiB = {nbytes / 2**20:.0f} MiB in {runs} slot runs")]


def _alternating_best(a, b, repeat: int) -> tuple[float, float]:
    """Best time of each of two functions, run alternately so that load from other
    processes on a shared machine falls on both alike."""
    best_a = best_b = float("inf")
    for _ in range(repeat):
        best_a = min(best_a, best_of(a, repeat=1))
        best_b = min(best_b, best_of(b, repeat=1))
    return best_a, best_b


def bench_store_burst(cache: LocalCache, prompts: list, quick: bool) -> list[Result]:
    """Lookups while 10k stores go through admission, the queue and the index."""
    rng = np.random.default_rng(4)
    n_stores = 2000 if quick else 10_000
    roots = _roots(40)
    new = [(roots[i % 40], rng.integers(0, 128_000, 256, dtype=np.uint32)) for i in range(n_stores)]
    for root, tokens in new:          # two sightings each, so every store is admitted
        cache.lookup(root, tokens)
        cache.lookup(root, tokens)
    chunk = 100
    idle: list[float] = []
    busy: list[float] = []
    picks = rng.integers(0, len(prompts), 2 * n_stores)
    it = iter(range(n_stores))
    k = 0
    for start in range(0, n_stores, chunk):
        for _ in range(chunk):
            root, tokens = prompts[picks[k]]
            k += 1
            t0 = time.perf_counter()
            hit = cache.lookup(root, tokens)
            idle.append(time.perf_counter() - t0)
            cache.release(hit)
        for _ in range(chunk):
            i = next(it, None)
            if i is None:
                break
            cache.store(new[i][0], new[i][1], None)   # applies itself in a bounded slice
            root, tokens = prompts[picks[k]]
            k += 1
            t0 = time.perf_counter()
            hit = cache.lookup(root, tokens)
            busy.append(time.perf_counter() - t0)
            cache.release(hit)
    p99_idle, p99_busy = _robust_p99(idle) * 1e6, _robust_p99(busy) * 1e6
    s = cache.stats()
    return [Result(
        f"lookup p99 during a burst of {n_stores:,} stores vs idle", p99_busy, "us", BURST_P99_FACTOR,
        "lower", "ratio", baseline=p99_idle, baseline_name="idle lookup p99, alternating chunks",
        note=f"median of per-{P99_GROUP}-sample p99s; plain p99 busy {percentile(busy, 0.99) * 1e6:.0f} "
             f"vs idle {percentile(idle, 0.99) * 1e6:.0f} us; p50 busy {percentile(busy, 0.5) * 1e6:.0f} vs "
             f"idle {percentile(idle, 0.5) * 1e6:.0f} us; stores applied {s.stores_applied:,}, "
             f"queue drops {s.queue_drops}, evictions {s.evictions:,}")]


P99_GROUP = 1000
"""p99 is taken per 1,000 consecutive samples and the median of those reported: a
few milliseconds of contention from other processes on a shared machine then move
one group's p99, not the figure."""


def _robust_p99(samples: list[float]) -> float:
    groups = [samples[i:i + P99_GROUP] for i in range(0, len(samples) - P99_GROUP + 1, P99_GROUP)]
    if not groups:
        return percentile(samples, 0.99)
    return statistics.median(percentile(g, 0.99) for g in groups)


def run(quick: bool = False) -> list[Result]:
    gc.collect()
    lookup, cache, prompts = bench_lookup(quick)
    cache.drain_budget_s = 0.0005  # stores now apply themselves in bounded slices
    results = lookup + bench_hashing(quick) + bench_materialize(quick)
    results += bench_store_burst(cache, prompts, quick)
    return results


def main() -> None:
    import sys

    quick = "--quick" in sys.argv
    print(f"bench_core on {machine()}{' (quick)' if quick else ''}")
    for r in run(quick):
        ratio = f" ratio {r.ratio:.2f}" if r.ratio is not None else ""
        base = f" vs {r.baseline:.4g}" if r.baseline is not None else ""
        print(f"{'PASS' if r.passed else 'FAIL'}  {r.name}: {r.value:.4g} {r.unit}{base}{ratio} "
              f"(target {r.direction} {r.target}) {r.note}")


if __name__ == "__main__":
    main()
