"""The local demo replays a workload through LocalCache with the reference engine."""
import subprocess
import sys

from kvtier_app.demo import run_local


def test_local_replay_hits_and_cached_kv_gives_recompute_logits():
    replay = run_local(n_requests=8, seed=3)
    assert replay.requests == 8
    assert replay.hits > 0, "shared system prompts and documents must hit by the second sighting"
    assert 0 < replay.tokens_saved < replay.prompt_tokens
    assert replay.max_logit_diff < 1e-4


def test_cli_survives_a_closed_pipe():
    cmd = f"{sys.executable} -m kvtier_app breakeven --model llama-3-70b --gpu h100 --tp 4 | head -c 10"
    out = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60)
    assert "Traceback" not in out.stderr, out.stderr
