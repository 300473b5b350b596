"""Run by bench_vllm with the vLLM venv's python: time loading a hit from a real
sidecar's shared-memory arena into paged KV tensors laid out as vLLM's CPU backend
lays them out, and saving one back (kvtier_vllm.paged, the connector's own copy path,
in the block format that layout stores), each against a plain copy of the same bytes
in one call, interleaved rep by rep so a busy machine slows both alike.

- load: lookup (pinned hit) -> PagedKV.copy(to_paged=True) -> release
- save: lookup (a sighting) -> begin_store -> PagedKV.copy(to_paged=False) -> commit_store
- memcpy: as many consecutive arena slots as the hit has -> a plain buffer, and back,
  each one numpy copy (glibc's memcpy, which streams copies this big)
- pieces: the same bytes as the load, in pieces the size of the load's copies (one
  block's layer) with numpy's copy, which the connector used before its streaming copy

Every timed copy starts with the caches swept (`sweep`, untimed): a hit of a small
model is a few MB, and a copy into lines the previous step left in the last-level
cache (the memcpy baseline writing back the slots it had just read) would otherwise
race one that writes lines fetched from memory (a save into freshly reserved slots).

Prints one JSON line."""
import json
import random
import statistics
import sys
import time

import numpy as np
import torch

from kvtier import memcopy
from kvtier.keys import KeyRoot
from kvtier_sidecar.client import SidecarClient
from kvtier_vllm.layouts import PagedLayout, block_planes
from kvtier_vllm.paged import PagedKV

spec = json.loads(sys.argv[1])
layers, heads, dim, block = spec["layers"], spec["kv_heads"], spec["head_dim"], spec["block_size"]
dtype = getattr(torch, spec["dtype"])
tokens, reps = spec["tokens"], spec["reps"]
n = tokens // block
pages = n + 8
tensors = [torch.zeros(pages, heads, block, 2 * dim, dtype=dtype) for _ in range(layers)]
paged = PagedKV.from_tensors(tensors, PagedLayout.CPU_VEC, heads, dim, block, block)
client = SidecarClient(spec["socket"])
assert client.connect(), "the sidecar did not answer"
root = KeyRoot(*spec["root"])
block_bytes = client.info["block_bytes"]
assert block_bytes == layers * 2 * heads * block * dim * paged.itemsize, (block_bytes, paged.format_shape)
block_ids = list(range(pages - n, pages))  # the request's vLLM blocks, contiguous like a fresh engine's
rng = random.Random(spec["seed"])
for t in tensors:  # KV bytes as the engine wrote them
    t.view(torch.int16 if paged.itemsize == 2 else torch.int32).random_(0, 1 << 14)
plain = np.empty(n * block_bytes, dtype=np.uint8)


def prompt() -> list[int]:
    """n full blocks and one token more: a lookup always leaves a token to compute."""
    return [rng.randrange(3, 30000) for _ in range(n * block + 1)]


SCRATCH = np.zeros(64 << 20, dtype=np.uint8)
"""Twice this machine kind's last-level cache (32 MiB)."""


def sweep() -> None:
    """Write one byte of every line of SCRATCH: what a step left in the caches is
    written back and evicted, so the next copy reads and writes memory."""
    SCRATCH[::64] += 1


def save(tokens_: list[int]) -> tuple[float, float]:
    """(begin_store + copy + commit_store, the copy alone) seconds."""
    client.lookup(root, tokens_)  # a sighting, as the scheduler's lookup makes
    sweep()
    t0 = time.perf_counter()
    res = client.begin_store(root, tokens_)
    assert res is not None and len(res.slots) == n, "the sidecar declined the store"
    t1 = time.perf_counter()
    paged.copy(res.arena, res.slots, block_ids, res.first_block, to_paged=False)
    t2 = time.perf_counter()
    assert client.commit_store(res)
    t = time.perf_counter() - t0
    # Settle, untimed: after a store the sidecar hashes the new blocks in the background
    # (for peer serving); a lookup asking for digests waits for them, so that work does
    # not land inside the next figure's timing.
    client.release(client.lookup(root, tokens_, digests=True))
    return t, t2 - t1


def load(tokens_: list[int]) -> tuple[float, float]:
    """(lookup + copy + release, the copy alone) seconds."""
    sweep()
    t0 = time.perf_counter()
    hit = client.lookup(root, tokens_)
    assert hit and len(hit.blocks) == n, "the stored prompt did not hit"
    t1 = time.perf_counter()
    paged.copy(client.arena, hit.blocks, block_ids, 0, to_paged=True)
    t2 = time.perf_counter()
    client.release(hit)
    return time.perf_counter() - t0, t2 - t1


def region(hit) -> np.ndarray:
    """n consecutive arena slots from the hit's first: one memcpy's worth of the
    arena, the same size as the hit (its own slots need not be consecutive)."""
    start = min(min(hit.blocks), client.arena.slots - n)
    return client.arena.slot_array(start, n)


def memcpy_pair(tokens_: list[int]) -> tuple[float, float]:
    """(arena -> plain, plain -> arena) of a hit's worth of arena bytes, each one copy;
    the second writes back what the first read, so every stored block stays intact."""
    hit = client.lookup(root, tokens_)
    slots = region(hit)
    sweep()
    t0 = time.perf_counter()
    np.copyto(plain, slots)
    t1 = time.perf_counter()
    sweep()
    t2 = time.perf_counter()
    np.copyto(slots, plain)
    t3 = time.perf_counter()
    client.release(hit)
    return t1 - t0, t3 - t2


piece = block_bytes // layers
plain_pieces = plain.reshape(-1, piece)


def pieces(tokens_: list[int]) -> float:
    hit = client.lookup(root, tokens_)
    src_pieces = region(hit).reshape(-1, piece)
    sweep()
    t0 = time.perf_counter()
    for i in range(len(src_pieces)):
        np.copyto(plain_pieces[i], src_pieces[i])
    t = time.perf_counter() - t0
    client.release(hit)
    return t


# Map every arena page into this process, as a serving engine has after its first
# loads: otherwise a save's first write to each slot takes a page fault the memcpy
# baseline (into slots already touched) does not. Nothing is stored yet.
arena_bytes = client.arena.array
arena_bytes[::4096] = arena_bytes[::4096]
names = ("save", "save_copy", "load", "load_copy", "memcpy_load", "memcpy_save", "pieces")
samples: dict[str, list[float]] = {k: [] for k in names}
for rep in range(reps + 1):  # the first round warms the buffers' pages
    p = prompt()
    got = (*save(p), *load(p), *memcpy_pair(p), pieces(p))
    if rep:
        for k, v in zip(names, got):
            samples[k].append(v)
# the bytes landed where vLLM's kernels read them: a stored block's layer-0 K and V
# equal the pages it was saved from, and a load of it reproduces them
hit = client.lookup(root, p)
stored = client.arena.slot_array(hit.blocks[0]).view(paged.layers[0][1].dtype).reshape(1, *paged.format_shape)
for plane, stored_plane in zip(paged.layers[0], block_planes(stored, paged.fmt, 0, dim)):
    assert np.array_equal(plane[block_ids[0], 0], stored_plane[0])
client.release(hit)
print(json.dumps({"bytes": n * block_bytes, "tokens": n * block, "piece_bytes": piece,
                  "streaming": memcopy.native(), **{f"{k}_s": statistics.median(v) for k, v in samples.items()}}))
