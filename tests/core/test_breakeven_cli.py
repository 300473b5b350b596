"""`kvtier breakeven` through the real console script."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

KVTIER = Path(sys.executable).with_name("kvtier")


def kvtier(*args: str) -> subprocess.CompletedProcess:
    assert KVTIER.exists(), f"console script missing at {KVTIER}: run scripts/setup.sh"
    return subprocess.run([str(KVTIER), "breakeven", *args], capture_output=True, text=True, timeout=60)


def test_text_output_shows_the_design_figures_for_70b_tp4():
    out = kvtier("--model", "llama-3-70b", "--gpu", "h100", "--tp", "4")
    assert out.returncode == 0, out.stderr
    for figure in ("327,680 B", "35.4 us", "9.26 GB/s", "625 MiB", "6.9x", "2.7x", "0.8x", "0.1x"):
        assert figure in out.stdout
    nvme = next(line for line in out.stdout.splitlines() if line.startswith("nvme"))
    assert "refused" in nvme


def test_json_output_with_shape_flags_custom_medium_and_batch_traffic():
    out = kvtier("--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--params", "70e9",
                 "--tflops", "989.5", "--tp", "4", "--traffic", "batch", "--concurrency", "8",
                 "--medium", "cxl=32", "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["kv_bytes_per_token"] == 327_680
    assert round(r["break_even_gbps"], 2) == 9.26
    media = {m["name"]: m for m in r["media"]}
    assert media["cxl"]["gbps"] == 32.0 and media["cxl"]["effective_gbps"] == 4.0
    assert round(media["nvme"]["effective_gbps"], 1) == 0.9
    assert media["nvme"]["verdict"] == "serve" and media["nvme"]["capacity"]["helps"] is True


def test_fp8_and_kv_bytes_override_flags():
    fp8 = json.loads(kvtier("--model", "llama-3-70b", "--tp", "4", "--kv-dtype", "fp8", "--json").stdout)
    assert round(fp8["break_even_gbps"], 2) == 4.63
    mla = json.loads(kvtier("--model", "llama-3-70b", "--kv-bytes-per-token", "70272", "--json").stdout)
    assert mla["kv_bytes_per_token"] == 70272


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--model", "gpt-5"], "--model"),
        (["--model", "llama-3-70b", "--gpu", "tpu9"], "--gpu"),
        (["--model", "llama-3-70b", "--tp", "0"], "--tp"),
        (["--model", "llama-3-70b", "--tflops", "-5"], "--tflops"),
        (["--model", "llama-3-70b", "--concurrency", "0"], "--concurrency"),
        (["--model", "llama-3-70b", "--medium", "disk=0"], "--medium"),
        (["--model", "llama-3-70b", "--medium", "disk"], "--medium"),
        (["--model", "llama-3-70b", "--kv-dtype", "int4"], "--kv-dtype"),
        (["--params", "7e9"], "--layers"),
        (["--layers", "0", "--kv-heads", "8", "--head-dim", "128", "--params", "7e9"], "--layers"),
        (["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--params", "-7e9"], "--params"),
        (["--tp", "2"], "--model"),
    ],
)
def test_bad_input_exits_2_naming_the_flag(args, flag):
    out = kvtier(*args)
    assert out.returncode == 2
    assert flag in out.stderr
    assert out.stdout == ""
