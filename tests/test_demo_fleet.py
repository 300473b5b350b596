"""The checkout's fleet demo (`./scripts/demo.sh --mode fleet`): Redis + sidecar processes +
reference engines on loopback."""
import json
import subprocess
import sys


def test_fleet_demo_hits_in_dram_and_peer_tiers_with_no_wrong_kv():
    out = subprocess.run([sys.executable, "-m", "kvtier_testenv.demo", "--mode", "fleet", "--requests", "20",
                          "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["requests"] == 80
    assert report["wrong_kv"] == 0 and report["errors"] == 0
    assert report["tiers"]["dram"]["hits"] > 0
    assert report["bytes_materialized"] > 0
