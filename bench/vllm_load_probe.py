"""Run by bench_vllm with the vLLM venv's python: time loading a 2,000-token hit from
a real shared-memory arena into paged KV tensors laid out as vLLM's CPU backend
lays them out (kvtier_vllm.paged, the connector's own copy path, in the block format
that layout stores), against a plain copy of the same bytes out of the same arena.
Prints one JSON line."""
import json
import statistics
import sys
import time

import numpy as np
import torch

from kvtier_sidecar.arena import Arena
from kvtier_vllm.layouts import PagedLayout, block_planes
from kvtier_vllm.paged import PagedKV

spec = json.loads(sys.argv[1])
layers, heads, dim, block = spec["layers"], spec["kv_heads"], spec["head_dim"], spec["block_size"]
dtype = getattr(torch, spec["dtype"])
tokens, reps = spec["tokens"], spec["reps"]
n = tokens // block
pages = 2 * n + 8
tensors = [torch.zeros(pages, heads, block, 2 * dim, dtype=dtype) for _ in range(layers)]
paged = PagedKV.from_tensors(tensors, PagedLayout.CPU_VEC, heads, dim, block, block)
block_bytes = layers * 2 * heads * block * dim * paged.itemsize
arena = Arena.create(f"kvtier-bench-{spec['tag']}", n + 4, block_bytes)
try:
    arena.array[:] = np.random.default_rng(0).integers(0, 255, arena.array.size, dtype=np.uint8) & 0x3F
    slots = list(range(2, 2 + n))
    block_ids = list(range(pages - n, pages))   # the request's vLLM blocks, contiguous like a fresh engine's
    plain = np.empty(n * block_bytes, dtype=np.uint8)
    src = arena.slot_array(slots[0], n)

    def timed(fn) -> float:
        fn()
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    load_s = timed(lambda: paged.copy(arena, slots, block_ids, 0, to_paged=True))
    memcpy_s = timed(lambda: np.copyto(plain, src))
    # the same bytes in pieces the size of the load's copies (one block's layer): a
    # copy whose pieces are smaller than glibc's non-temporal threshold uses ordinary
    # stores, which also read each destination line first
    piece = block_bytes // layers
    plain_pieces, src_pieces = plain.reshape(-1, piece), src.reshape(-1, piece)

    def pieces():
        for i in range(len(src_pieces)):
            np.copyto(plain_pieces[i], src_pieces[i])
    pieces_s = timed(pieces)
    # the bytes landed where vLLM's kernels read them: the first block's layer-0 K and V
    stored = arena.slot_array(slots[0]).view(paged.layers[0][1].dtype).reshape(1, *paged.format_shape)
    for plane, stored_plane in zip(paged.layers[0], block_planes(stored, paged.fmt, 0, dim)):
        assert np.array_equal(plane[block_ids[0], 0], stored_plane[0])
    print(json.dumps({"bytes": n * block_bytes, "tokens": n * block, "load_s": load_s, "memcpy_s": memcpy_s,
                      "pieces_s": pieces_s, "piece_bytes": piece}))
finally:
    arena.close()
