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


# As installed from the wheel: the test environment's (editable) finder is not there.
_WITHOUT_TESTENV = """
import sys
sys.meta_path = [f for f in sys.meta_path if "kvtier_testenv" not in getattr(f, "__module__", "")]
sys.argv = ["kvtier", "demo", "--mode", sys.argv[1]]
from kvtier_app.cli import main
sys.exit(main())
"""


def test_installed_without_the_test_environment_the_fleet_and_cluster_demos_say_what_to_do():
    for mode in ("fleet", "cluster"):
        out = subprocess.run([sys.executable, "-c", _WITHOUT_TESTENV, mode], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2, out.stderr
        assert "needs the test environment" in out.stderr and "--mode local" in out.stderr
        assert "Traceback" not in out.stderr
