"""The connector's CPU copies (kvtier_vllm.paged over kvtier.memcopy): a save into
scattered arena slots and a load into scattered pages move exactly the request's bytes,
the same bytes by the streaming path as by numpy's, and touch nothing else."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvtier_testenv.vllm_engine import vllm_env, vllm_python

pytestmark = pytest.mark.vllm


def test_scattered_saves_and_loads_are_exact_by_either_copy_path():
    script = Path(__file__).with_name("paged_copy.py")
    out = subprocess.run([vllm_python(), str(script)], capture_output=True, text=True, timeout=300,
                         env=vllm_env())
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    want = {"streaming_exact": True, "numpy_exact": True, "same_arena_bytes": True, "arena_nonzero": True}
    assert result == {"streaming": True, "float16": want, "bfloat16": want}
