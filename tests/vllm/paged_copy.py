"""Run by test_paged_copy with the vLLM venv's python: a request's blocks saved from
CPU_VEC KV tensors into scattered arena slots and loaded back into other scattered
pages, by the streaming path and by the numpy path, for fp16 and bf16; prints one JSON
line saying whether every byte landed where it should."""
import json
import os

import numpy as np
import torch

from kvtier import memcopy, presets
from kvtier_sidecar.arena import Arena
from kvtier_vllm.layouts import PagedLayout
from kvtier_vllm.paged import PagedKV

layers, heads, dim, block, pages, n = 3, 2, 64, 16, 12, 5
out = {"streaming": memcopy.native()}
native_copy = memcopy._native
for dtype in (torch.float16, torch.bfloat16):
    src = [torch.randint(-30000, 30000, (pages, heads, block, 2 * dim), dtype=torch.int16).view(dtype)
           for _ in range(layers)]
    results = []
    for native in (native_copy, None):  # the streaming copy, then numpy's
        memcopy._native = native
        memcopy.STREAM_MIN_TOTAL_BYTES = 0  # these few KB stream too, as a real model's hundreds of MB do
        paged = PagedKV.from_tensors(src, PagedLayout.CPU_VEC, heads, dim, block, block)
        block_bytes = presets.kv_bytes_per_token(layers, heads, dim, dtype.itemsize) * block
        arena = Arena.create(f"kvtier-test-{os.getpid()}", 16, block_bytes)
        try:
            arena.array[:] = 0
            slots, saved_from = [9, 2, 3, 14, 0], [7, 1, 2, 11, 4]  # scattered on both sides
            paged.copy(arena, slots, saved_from, 0, to_paged=False)
            stored = bytes(arena.array)
            dst = [torch.zeros_like(t) for t in src]
            back = PagedKV.from_tensors(dst, PagedLayout.CPU_VEC, heads, dim, block, block)
            loaded_into = [5, 6, 0, 10, 3]
            back.copy(arena, slots, loaded_into, 0, to_paged=True)
            exact = all(torch.equal(d[p].view(torch.int16), s[q].view(torch.int16))
                        for d, s in zip(dst, src) for p, q in zip(loaded_into, saved_from))
            untouched = all(not d[p].view(torch.int16).any() for d in dst for p in range(pages)
                            if p not in loaded_into)
            # only layer 1 of the same request: the other layers' pages stay as they were
            only = [torch.zeros_like(t) for t in src]
            PagedKV.from_tensors(only, PagedLayout.CPU_VEC, heads, dim, block, block).copy(
                arena, slots, loaded_into, 0, True, (1,))
            one_layer = (torch.equal(only[1].view(torch.int16), dst[1].view(torch.int16)) and not only[0].view(torch.int16).any()
                         and not only[2].view(torch.int16).any())
            results.append((stored, exact, untouched, one_layer))
        finally:
            arena.close()
    (s_stream, *flags_stream), (s_numpy, *flags_numpy) = results
    out[str(dtype).removeprefix("torch.")] = {"streaming_exact": all(flags_stream), "numpy_exact": all(flags_numpy),
                                              "same_arena_bytes": s_stream == s_numpy,
                                              "arena_nonzero": any(s_stream)}
print(json.dumps(out))
