"""A tiny Llama-shaped model on disk: config.json + seeded random float32 weights.

vLLM's "dummy" load format gives near-uniform logits, which cannot tell right KV
from wrong; these weights are random but of unit-scale activations, so a greedy
continuation depends on every cached K and V. Written with numpy in the safetensors
format (an 8-byte header length, a JSON header, raw little-endian tensors), so no
torch is needed to make it.
"""
from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class TinyLlama:
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    vocab: int = 1000
    max_positions: int = 4096
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def hf_config(self) -> dict:
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": self.hidden, "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim, "vocab_size": self.vocab,
            "max_position_embeddings": self.max_positions, "rope_theta": self.rope_theta,
            "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
            "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
        }

    def weights(self, seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        h, d, kv = self.hidden, self.head_dim, self.kv_heads

        def linear(out: int, inp: int) -> np.ndarray:
            return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

        w = {"model.embed_tokens.weight": rng.standard_normal((self.vocab, h)).astype(np.float32),
             "model.norm.weight": np.ones(h, np.float32),
             "lm_head.weight": linear(self.vocab, h)}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            w[p + "self_attn.q_proj.weight"] = linear(self.heads * d, h)
            w[p + "self_attn.k_proj.weight"] = linear(kv * d, h)
            w[p + "self_attn.v_proj.weight"] = linear(kv * d, h)
            w[p + "self_attn.o_proj.weight"] = linear(h, self.heads * d)
            w[p + "mlp.gate_proj.weight"] = linear(self.intermediate, h)
            w[p + "mlp.up_proj.weight"] = linear(self.intermediate, h)
            w[p + "mlp.down_proj.weight"] = linear(h, self.intermediate)
            w[p + "input_layernorm.weight"] = np.ones(h, np.float32)
            w[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
        return w


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name], dtype="<f4")
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        blobs.append(a.tobytes())
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for blob in blobs:
            f.write(blob)


def write_model(directory: Path, seed: int = 0, shape: TinyLlama = TinyLlama()) -> Path:
    """Write config.json and model.safetensors into `directory`; returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(shape.hf_config(), indent=1))
    write_safetensors(directory / "model.safetensors", shape.weights(seed))
    (directory / "kvtier-shape.json").write_text(json.dumps({**asdict(shape), "seed": seed}))
    return directory
