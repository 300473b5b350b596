"""Run by test_cpu_kernel_layout with the vLLM venv's python: vLLM's own CPU kernel
(cpu_attn_reshape_and_cache, the op its attention layers write KV with) fills a
paged cache, and kvtier_vllm's CPU_VEC view must find every token's K and V there.
Prints one JSON line: {"tokens": n, "k_equal": bool, "v_equal": bool}."""
import json

import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa

from kvtier_vllm.layouts import PagedLayout, kv_views, layout_for

pages, heads, page_tokens, head_dim = 6, 2, 32, 64
gen = torch.Generator().manual_seed(0)
cache = torch.zeros(pages, heads, page_tokens, 2 * head_dim, dtype=torch.float32)
tokens = 80
key = torch.randn(tokens, heads, head_dim, generator=gen)
value = torch.randn(tokens, heads, head_dim, generator=gen)
page_of = [4, 1, 5]  # token t lives in page page_of[t // 32], offset t % 32
slots = torch.tensor([page_of[t // page_tokens] * page_tokens + t % page_tokens for t in range(tokens)])
# exactly how CPUAttentionBackendImpl hands the cache to the kernel
rows = cache.view(pages, heads, page_tokens * 2, head_dim)
key_cache, value_cache = rows.chunk(2, dim=2)
ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots,
                               _get_attn_isa(torch.float32, page_tokens, head_dim))
isa = _get_attn_isa(torch.float32, page_tokens, head_dim)
layout = layout_for(CPUAttentionBackend.get_name(), cache.shape, heads, head_dim, cpu_kernel=isa)
k, v = kv_views(cache, layout, head_dim)
k_ok = all(torch.equal(k[page_of[t // 32], :, t % 32], key[t]) for t in range(tokens))
v_ok = all(torch.equal(v[page_of[t // 32], :, t % 32], value[t]) for t in range(tokens))
print(json.dumps({"tokens": tokens, "layout": layout.value, "isa": isa, "k_equal": k_ok, "v_equal": v_ok}))
