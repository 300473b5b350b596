"""A tiny decoder-only transformer in numpy whose prefill produces real K and V.

It stands in for a serving engine in tests, benchmarks and the demo: GQA, RoPE
with a configurable theta, RMSNorm, SwiGLU, fp32 or fp16 weights and KV, and
weights drawn from a seed that plays the role of the weights version. Prefill can
start from cached K/V of a prefix (materialized from `LocalCache` through the
canonical layout of `kvtier.layout`) and compute only the suffix; because both
paths round K/V to the KV dtype before attention, a cached prefix gives the same
logits as recomputing it, to fp32 rounding.

Everything that changes what prefill produces is in `key_root()`: the weights
(digest of the generator, seed, shapes and dtype), the KV dtype, the RoPE config
and the attention implementation. TP degree is not: there is none here, and the
canonical layout makes it irrelevant anyway.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass

import numpy as np

from kvtier.breakeven import FLOPS_PER_PARAM_PER_TOKEN
from kvtier.dtypes import KvDtype
from kvtier.keys import DEFAULT_BLOCK_SIZE, KeyRoot, as_token_array
from kvtier.layout import KVShape, blocks_view, from_canonical_blocks, to_canonical_blocks

# Names the weight generator, so a different generator is a different weights version.
WEIGHTS_GENERATOR = "kvtier-ref/numpy-pcg64-normal/v1"
ATTN_IMPL = "kvtier-ref/numpy-sdpa-causal/v1"
# The KV dtypes numpy computes in (`kvtier.dtypes.KvDtype`; bf16 and fp8 it cannot).
COMPUTE_DTYPES = {d.value: d.storage.type for d in (KvDtype.FP32, KvDtype.FP16)}
RMS_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class TransformerConfig:
    """Shape and identity of the reference model. `weights_seed` stands for the weights."""

    vocab: int = 512
    layers: int = 2
    d_model: int = 128
    q_heads: int = 4
    kv_heads: int = 2
    ffn: int = 256
    rope_theta: float = 10_000.0
    dtype: str = "fp32"
    weights_seed: int = 0
    model_id: str = "kvtier-ref"

    def __post_init__(self) -> None:
        for name in ("vocab", "layers", "d_model", "q_heads", "kv_heads", "ffn"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"TransformerConfig.{name} must be a positive integer, got {v!r}")
        if self.d_model % self.q_heads or self.q_heads % self.kv_heads:
            raise ValueError("d_model must divide by q_heads and q_heads by kv_heads (GQA)")
        if (self.d_model // self.q_heads) % 2:
            raise ValueError("head_dim must be even for RoPE")
        if self.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"TransformerConfig.dtype must be one of {sorted(COMPUTE_DTYPES)}, got {self.dtype!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"TransformerConfig.rope_theta must be > 0, got {self.rope_theta!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.q_heads

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token (the 2 x params of recompute)."""
        kv = self.kv_heads * self.head_dim
        per_layer = self.d_model * (self.d_model + 2 * kv) + self.d_model * self.d_model + 3 * self.d_model * self.ffn
        return self.layers * per_layer + self.d_model * self.vocab

    def kv_shape(self, block_size: int = DEFAULT_BLOCK_SIZE) -> KVShape:
        return KVShape(self.layers, self.kv_heads, self.head_dim, self.dtype, block_size)


@dataclass(slots=True)
class Prefill:
    """Logits for each computed (suffix) position and K, V for the whole sequence,
    each [layer][kv_head][token][head_dim] in the KV dtype."""

    logits: np.ndarray
    k: np.ndarray
    v: np.ndarray
    computed_tokens: int


@dataclass(slots=True)
class _Layer:
    attn_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    ffn_norm: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray


class ReferenceTransformer:
    """The model plus its prefill. Weights are held in the configured dtype's
    precision; arithmetic runs in fp32 (numpy has no fast fp16 matmul)."""

    def __init__(self, config: TransformerConfig | None = None):
        self.config = config or TransformerConfig()
        self._dtype = np.dtype(COMPUTE_DTYPES[self.config.dtype])
        self._build_weights()
        self._inv_freq = 1.0 / (
            self.config.rope_theta ** (np.arange(0, self.config.head_dim, 2, dtype=np.float64) / self.config.head_dim)
        )

    # ------------------------------------------------------------------ identity

    def weights_version(self) -> str:
        """Exact digest of the weights: the generator, seed, shapes and precision fix them."""
        c = self.config
        spec = {"generator": WEIGHTS_GENERATOR, "seed": c.weights_seed, "dtype": c.dtype,
                **{k: getattr(c, k) for k in ("vocab", "layers", "d_model", "q_heads", "kv_heads", "ffn")}}
        return "sha256:" + hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()

    def rope_config_hash(self) -> str:
        spec = {"theta": self.config.rope_theta, "head_dim": self.config.head_dim, "scaling": None, "style": "half"}
        return "rope-" + hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]

    def key_root(self, tenant: str) -> KeyRoot:
        return KeyRoot(tenant, self.config.model_id, self.weights_version(), self.config.dtype,
                       self.rope_config_hash(), ATTN_IMPL)

    # ------------------------------------------------------------------ numbers

    @property
    def matmul_params(self) -> int:
        return self.config.matmul_params

    def matmul_shapes(self) -> list[tuple[int, int, int]]:
        """(in, out, times) of each per-token weight matmul, for measuring FLOP/s on these shapes."""
        c = self.config
        kv = c.kv_heads * c.head_dim
        return [(c.d_model, c.d_model, c.layers), (c.d_model, kv, 2 * c.layers), (c.d_model, c.d_model, c.layers),
                (c.d_model, c.ffn, 2 * c.layers), (c.ffn, c.d_model, c.layers), (c.d_model, c.vocab, 1)]

    def measure(self, n_tokens: int = 128, rounds: int = 4, seed: int = 0) -> tuple[float, float]:
        """(prefill seconds per token, matmul FLOP/s on this model's shapes), measured
        interleaved, best of `rounds` each, so a load spike hits both alike.

        The FLOP rate is what the break-even formula takes as "dense FLOP/s": the
        weight matmuls of one prefill of `n_tokens`, timed on their own.
        """
        rng = np.random.default_rng(seed)
        tokens = rng.integers(0, self.config.vocab, n_tokens)
        mats = [(rng.standard_normal((n_tokens, i), dtype=np.float32), rng.standard_normal((i, o), dtype=np.float32), n)
                for i, o, n in self.matmul_shapes()]
        best_prefill = best_matmul = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            self.prefill(tokens)
            t1 = time.perf_counter()
            for a, b, n in mats:
                for _ in range(n):
                    a @ b
            t2 = time.perf_counter()
            best_prefill, best_matmul = min(best_prefill, t1 - t0), min(best_matmul, t2 - t1)
        flops = FLOPS_PER_PARAM_PER_TOKEN * self.matmul_params * n_tokens
        return best_prefill / n_tokens, flops / best_matmul

    # ------------------------------------------------------------------ prefill

    def prefill(self, token_ids, past: tuple[np.ndarray, np.ndarray] | None = None) -> Prefill:
        """Run the prompt; with `past` = (k, v) of its first P tokens, compute only the rest.

        Returns logits for the computed positions and K/V for all of them.
        """
        c = self.config
        tokens = as_token_array(token_ids)
        if int(tokens.max()) >= c.vocab:
            raise ValueError(f"token id {int(tokens.max())} is outside the vocabulary ({c.vocab})")
        start = 0 if past is None else self._check_past(past, len(tokens))
        if start >= len(tokens):
            raise ValueError("the cached prefix covers the whole prompt: at least one token must be computed")
        x = self._embed[tokens[start:]].astype(np.float32)
        cos, sin = self._rope(start, len(tokens))
        ks, vs = [], []
        for i, layer in enumerate(self._layers):
            past_kv = None if past is None else (past[0][i], past[1][i])
            x, k, v = self._block(layer, x, cos, sin, past_kv, start)
            ks.append(k)
            vs.append(v)
        logits = _rms_norm(x, self._final_norm) @ self._lm_head
        return Prefill(logits, np.stack(ks), np.stack(vs), len(tokens) - start)

    def kv_blocks(self, result: Prefill, block_size: int = DEFAULT_BLOCK_SIZE) -> np.ndarray:
        """The full blocks of a prefill's K/V in the canonical layout, ready for `LocalCache.store`."""
        return to_canonical_blocks(result.k, result.v, self.config.kv_shape(block_size))

    def past_from_blocks(self, buf, block_size: int = DEFAULT_BLOCK_SIZE) -> tuple[np.ndarray, np.ndarray]:
        """K, V for a prefix from canonical bytes (e.g. what `LocalCache.materialize` wrote)."""
        shape = self.config.kv_shape(block_size)
        return from_canonical_blocks(blocks_view(buf, shape), shape)

    # ------------------------------------------------------------------ internals

    def _block(self, w: _Layer, x, cos, sin, past_kv, start):
        c = self.config
        t = len(x)
        h = _rms_norm(x, w.attn_norm)
        q = (h @ w.wq).reshape(t, c.q_heads, c.head_dim).transpose(1, 0, 2)
        k = (h @ w.wk).reshape(t, c.kv_heads, c.head_dim).transpose(1, 0, 2)
        v = (h @ w.wv).reshape(t, c.kv_heads, c.head_dim).transpose(1, 0, 2)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        # Round K/V to the KV dtype HERE, before attention: a cached prefix (stored in
        # that dtype) and a recomputed one then feed attention identical values.
        k, v = k.astype(self._dtype), v.astype(self._dtype)
        if past_kv is not None:
            k = np.concatenate([past_kv[0], k], axis=1)
            v = np.concatenate([past_kv[1], v], axis=1)
        attn = _causal_attention(q, k.astype(np.float32), v.astype(np.float32), start)
        x = x + attn.transpose(1, 0, 2).reshape(t, c.d_model) @ w.wo
        h = _rms_norm(x, w.ffn_norm)
        x = x + (_silu(h @ w.w_gate) * (h @ w.w_up)) @ w.w_down
        return x, k, v

    def _rope(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        angles = np.arange(start, end, dtype=np.float64)[:, None] * self._inv_freq[None, :]
        return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)

    def _check_past(self, past, n_tokens: int) -> int:
        c = self.config
        k, v = past
        want = (c.layers, c.kv_heads)
        if k.shape != v.shape or k.shape[:2] != want or k.shape[3] != c.head_dim:
            raise ValueError(f"past K/V must be ({c.layers}, {c.kv_heads}, tokens, {c.head_dim}), got {k.shape}")
        if k.dtype != self._dtype:
            raise ValueError(f"past K/V dtype {k.dtype} does not match the engine's {self._dtype}")
        return k.shape[2]

    def _build_weights(self) -> None:
        c = self.config
        rng = np.random.default_rng(c.weights_seed)

        def dense(n_in: int, n_out: int) -> np.ndarray:
            w = rng.standard_normal((n_in, n_out), dtype=np.float32) / np.sqrt(n_in)
            return w.astype(self._dtype).astype(np.float32)  # held at the weights' precision

        def norm(n: int) -> np.ndarray:
            return (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(self._dtype).astype(np.float32)

        self._embed = rng.standard_normal((c.vocab, c.d_model), dtype=np.float32).astype(self._dtype)
        kv = c.kv_heads * c.head_dim
        self._layers = [
            _Layer(norm(c.d_model), dense(c.d_model, c.d_model), dense(c.d_model, kv), dense(c.d_model, kv),
                   dense(c.d_model, c.d_model), norm(c.d_model), dense(c.d_model, c.ffn), dense(c.d_model, c.ffn),
                   dense(c.ffn, c.d_model))
            for _ in range(c.layers)
        ]
        self._final_norm = norm(c.d_model)
        self._lm_head = dense(c.d_model, c.vocab)


def _rms_norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + RMS_EPS) * weight


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE on [heads, tokens, head_dim] at the positions cos/sin were built for."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> np.ndarray:
    """q [Hq, T, D] at positions start..start+T-1; k, v [Hkv, start+T, D]. GQA by grouping.

    One 2-D matmul per kv head (its G query heads stacked), so numpy hands each to BLAS.
    """
    hq, t, d = q.shape
    hkv, total, _ = k.shape
    g = hq // hkv
    future = np.arange(total)[None, :] > (start + np.arange(t))[:, None]  # [T, total]
    out = np.empty((hkv, g * t, d), dtype=np.float32)
    scale = np.float32(1.0 / np.sqrt(d))
    for h in range(hkv):
        scores = (q[h * g:(h + 1) * g].reshape(g * t, d) @ k[h].T) * scale
        scores = scores.reshape(g, t, total)
        scores[:, future] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        out[h] = scores.reshape(g * t, total) @ v[h]
    return out.reshape(hq, t, d)
