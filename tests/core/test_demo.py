"""The installed `kvtier demo` replays a workload through LocalCache with the reference
transformer, from the wheel alone."""
import json
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
sys.argv = ["kvtier", "demo", *sys.argv[1:]]
from kvtier_app.cli import main
code = main()
assert "kvtier_testenv" not in sys.modules
sys.exit(code)
"""


def test_installed_without_the_test_environment_the_demo_runs_and_the_checkout_modes_say_where_they_run():
    out = subprocess.run([sys.executable, "-c", _WITHOUT_TESTENV, "--requests", "4", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["mode"] == "local"
    for mode in ("fleet", "cluster"):
        out = subprocess.run([sys.executable, "-c", _WITHOUT_TESTENV, "--mode", mode], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 2, out.stderr
        assert f"./scripts/demo.sh --mode {mode}" in out.stderr
        assert "Traceback" not in out.stderr
