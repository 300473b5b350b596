"""The KV element types: one vocabulary for the layout, the break-even calculator, the
reference engine and the policy's `model.kvDtype`.

A key root's `kv_dtype` is the serving engine's own name for its cache dtype (vLLM
says "bfloat16", the reference engine "fp32"): it names blocks and is never parsed.
These names are for sizes and storage.
"""
from __future__ import annotations

from enum import Enum
from typing import Literal, get_args

import numpy as np


class KvDtype(str, Enum):
    """A KV cache element type, by its short name."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"

    @property
    def itemsize(self) -> int:
        """Bytes per KV element."""
        return _STORAGE[self].itemsize

    @property
    def storage(self) -> np.dtype:
        """How numpy holds it (bf16 and fp8 as raw bits: numpy has neither)."""
        return _STORAGE[self]


_STORAGE = {KvDtype.FP32: np.dtype(np.float32), KvDtype.FP16: np.dtype(np.float16),
            KvDtype.BF16: np.dtype(np.uint16), KvDtype.FP8: np.dtype(np.uint8)}

# The same names as a Literal, for wire models (the CRD's enum); equal to the enum's.
KvDtypeName = Literal["fp32", "fp16", "bf16", "fp8"]
assert get_args(KvDtypeName) == tuple(d.value for d in KvDtype)

DEFAULT_KV_DTYPE = KvDtype.FP16
"""The KV dtype of a model that does not say (a policy's `model.kvDtype`, the sidecar's
built-in model)."""

NAMES: tuple[str, ...] = tuple(d.value for d in KvDtype)
