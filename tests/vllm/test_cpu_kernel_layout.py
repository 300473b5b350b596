"""The CPU layout kvtier_vllm assumes is the one vLLM's own kernel writes."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvtier_testenv.vllm_engine import vllm_env, vllm_python

pytestmark = pytest.mark.vllm


def test_cpu_vec_view_reads_what_vllms_cpu_kernel_wrote():
    script = Path(__file__).with_name("cpu_kernel_layout.py")
    out = subprocess.run([vllm_python(), str(script)], capture_output=True, text=True, timeout=300,
                         env=vllm_env())
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"tokens": 80, "layout": "cpu_vec", "isa": "vec", "k_equal": True, "v_equal": True}
