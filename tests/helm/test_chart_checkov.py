"""checkov over the rendered chart, for every values combination the chart tests,
the install tests and the cluster demo use: no finding, except those the chart itself
suppresses with a written reason (a `checkov.io/skipN: CHECK=reason` annotation)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from helm_chart import helm, CHART

ROOT = Path(__file__).resolve().parents[2]
CHECKOV_SCRIPT = ROOT / "hack" / "checkov.sh"
SERVING = {"namespace": "serving", "name": "llm"}
DIGEST = "sha256:" + "0" * 64

# name -> values: the combinations tests/helm and the demo render or install.
VALUES = {
    "defaults": {},
    "webhook-off": {"webhook": {"enabled": False}},
    "webhook-url-and-placement": {
        "image": {"repository": "registry.local/kvtier", "tag": "1.2.3", "pullPolicy": "Always"},
        "operator": {"watchNamespaces": ["serving-a"], "healthPort": 18080, "verbose": True},
        "webhook": {"url": "https://127.0.0.1:19443/inject-sidecar", "port": 19443, "failurePolicy": "Fail"},
        "nodeSelector": {"node-role/control": "true"},
    },
    "cert-manager-tls": {"webhook": {"tls": {"secretName": "from-cert-manager", "caBundle": "Q0EK"}}},
    "demo": {"webhook": {"url": "https://127.0.0.1:19443/inject-sidecar", "port": 19443},
             "controlAuth": {"servingServiceAccounts": [SERVING]}},
    "digest-pinned": {"image": {"repository": "ghcr.io/kvtier/kvtier", "digest": DIGEST},
                      "controlAuth": {"servingServiceAccounts": [SERVING]}},
    "control-open": {"controlAuth": {"mode": "open"}},
    "metrics-protected": {"controlAuth": {"protectMetrics": True,
                                          "metricsUsers": ["system:serviceaccount:monitoring:prometheus"]}},
    "redis-secret": {"redisSecrets": [{"namespace": "serving", "name": "redis-auth"}]},
    # the kvtier Endpoint Picker (tests/helm/test_endpoint_picker.py), with its InferencePool
    "endpoint-picker": {"endpointPicker": {"enabled": True, "inferencePool": "always", "pools": [
        {"name": "llama", "namespace": "serving", "policy": "llama-70b", "selector": {"app": "vllm"},
         "redisUrl": "redis://kvtier-redis.serving:6379"}]}},
    "endpoint-picker-ha-pinned": {"endpointPicker": {
        "enabled": True, "replicas": 2, "secureServing": False,
        "image": {"repository": "ghcr.io/kvtier/kvtier-epp", "digest": DIGEST, "pullPolicy": "Always"},
        "pools": [{"name": "llama", "policy": "llama-70b", "selector": {"app": "vllm"}}]}},
}


def checkov_bin() -> Path:
    path = Path(subprocess.run(["bash", str(CHECKOV_SCRIPT), "--print-bin"], capture_output=True, text=True,
                               check=True).stdout.strip())
    assert path.is_file(), f"checkov missing at {path}: run scripts/setup.sh (or bash hack/checkov.sh)"
    return path


def checkov(values: dict, workdir: Path) -> list[dict]:
    rendered = workdir / "chart.yaml"
    rendered.write_text(helm("template", "kvtier", str(CHART), "--namespace", "kvtier-system", values=values).stdout)
    # --skip-download: the test runs offline (no Prisma Cloud guidelines needed).
    proc = subprocess.run([str(checkov_bin()), "-f", str(rendered), "--framework", "kubernetes", "--skip-download",
                           "--compact", "-o", "json"], capture_output=True, text=True, timeout=300)
    reports = json.loads(proc.stdout)
    return reports if isinstance(reports, list) else [reports]


@pytest.mark.parametrize("name", sorted(VALUES))
def test_rendered_chart_has_no_unexplained_checkov_finding(name, tmp_path):
    reports = checkov(VALUES[name], tmp_path)
    failed = [(f["check_id"], f["resource"], f["check_name"]) for r in reports
              for f in r["results"]["failed_checks"]]
    assert failed == [], failed
    skipped = [(s["check_id"], s["check_result"].get("suppress_comment")) for r in reports
               for s in r["results"]["skipped_checks"]]
    assert all(len(why or "") > 20 for _, why in skipped), skipped  # every suppression says why
    assert sum(r["summary"]["passed"] for r in reports) > 0  # it really checked something


def test_turning_the_network_policy_off_is_a_finding(tmp_path):
    reports = checkov({"networkPolicy": {"enabled": False}}, tmp_path)
    assert {f["check_id"] for r in reports for f in r["results"]["failed_checks"]} == {"CKV2_K8S_6"}
