"""`kvtier demo --mode cluster` end to end: its own control plane, the chart, the
operator pod, injected sidecars, a scale-up with warm-up; zero wrong KV."""
from __future__ import annotations

import json
import subprocess
import sys

from helm_chart import ROOT

# The demo normally takes ~20 s warm; the ceiling leaves room for a loaded CI machine.
DEMO_TIMEOUT_S = 300


def test_cluster_demo_scales_with_warm_up_and_serves_no_wrong_kv():
    proc = subprocess.run([sys.executable, "-m", "kvtier_app", "demo", "--mode", "cluster", "--json"],
                          capture_output=True, text=True, timeout=DEMO_TIMEOUT_S, cwd=ROOT)
    assert proc.returncode == 0, f"demo failed ({proc.returncode}):\n{proc.stderr[-4000:]}\n{proc.stdout[-2000:]}"
    result = json.loads(proc.stdout)
    assert result["ok"] is True
    before, after = result["phases"]["before"], result["phases"]["after"]
    assert before["members"] == ["llm-0", "llm-1", "llm-2"]
    assert after["members"] == ["llm-0", "llm-1", "llm-2", "llm-3"]
    for phase in (before, after):
        assert phase["requests"] > 0 and phase["wrong_kv"] == 0 and phase["errors"] == 0
        assert phase["tiers"]["dram"]["hits"] > 0, "templates repeat: the DRAM tier must serve hits"
    first, second = result["epochs"]
    assert second > first
    assert result["status"]["memberCount"] == 4 and result["status"]["epoch"] == second
    moved = result["moved_tenants"]
    assert all(m["to"] == "llm-3" for m in moved.values()), "with one home each, only the new pod gains tenants"
    assert len(moved) == result["status"]["movedTenants"]
    assert moved and any(m["warmed_bytes"] > 0 for m in moved.values())
    assert "demo" in result["kubectl_get_kvcp"] and "Ready" in result["kubectl_get_kvcp"]
    tiers = {t["tier"]: t["verdict"] for t in result["status"]["tiers"]}
    assert tiers["dram"] == "serve"
