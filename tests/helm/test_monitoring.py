"""The chart's monitoring objects, rendered by the real helm: the alert rules pass
`promtool check rules` and the promtool unit tests in alert_rules_test.yaml; the
PrometheusRule, PodMonitor and ServiceMonitor appear only behind their toggles and when
the prometheus-operator API is present; the dashboard ConfigMap carries Grafana's label."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from helm_chart import render
from kvtier_testenv.prometheus import RULES_KEY, chart_rules, promtool

HERE = Path(__file__).parent
MONITORING_APIS = ["--api-versions", "monitoring.coreos.com/v1/PrometheusRule",
                   "--api-versions", "monitoring.coreos.com/v1/PodMonitor",
                   "--api-versions", "monitoring.coreos.com/v1/ServiceMonitor"]


def test_default_rules_pass_promtool_check(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text(chart_rules())
    out = promtool("check", "rules", str(rules))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 8 rules found" in out.stdout


def test_rules_unit_tests_pass_promtool(tmp_path):
    (tmp_path / "rules.yaml").write_text(chart_rules())
    shutil.copy(HERE / "alert_rules_test.yaml", tmp_path / "t.yaml")
    out = promtool("test", "rules", "t.yaml", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_a_broken_expectation_fails_promtool(tmp_path):
    """The unit tests can fail: the same suite with one expected label changed does."""
    (tmp_path / "rules.yaml").write_text(chart_rules())
    text = (HERE / "alert_rules_test.yaml").read_text().replace("version: bad}", "version: old}", 1)
    (tmp_path / "t.yaml").write_text(text)
    out = promtool("test", "rules", "t.yaml", cwd=tmp_path)
    assert out.returncode != 0 and "KVTierHitRateDrop" in out.stdout + out.stderr


def test_rules_configmap_by_default_and_operator_objects_only_with_their_api_and_toggle():
    objects = render()
    cm = objects[("ConfigMap", "kvtier-alert-rules")]
    assert [g["name"] for g in yaml.safe_load(cm["data"][RULES_KEY])["groups"]] == ["kvtier.recording", "kvtier.alerts"]
    assert not any(kind in ("PrometheusRule", "PodMonitor", "ServiceMonitor") for kind, _ in objects)
    on = {"monitoring": {"rules": {"prometheusRule": True, "labels": {"release": "prom"}},
                         "podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True}}}
    # Toggled on but the CRDs are absent: nothing that would fail the install.
    assert not any(kind in ("PrometheusRule", "PodMonitor", "ServiceMonitor") for kind, _ in render(on))
    objects = render(on, extra=MONITORING_APIS)
    rule = objects[("PrometheusRule", "kvtier")]
    assert rule["metadata"]["labels"]["release"] == "prom"
    assert rule["spec"] == yaml.safe_load(objects[("ConfigMap", "kvtier-alert-rules")]["data"][RULES_KEY])
    pm = objects[("PodMonitor", "kvtier-sidecars")]["spec"]
    assert pm["podMetricsEndpoints"][0]["port"] == "kvtier-http"
    # Over the control port's TLS: the operator's CA (its public ConfigMap) and the name
    # every sidecar certificate carries for scrapers.
    assert pm["podMetricsEndpoints"][0]["scheme"] == "https"
    assert pm["podMetricsEndpoints"][0]["tlsConfig"] == {
        "ca": {"configMap": {"name": "kvtier-control-ca", "key": "ca.crt"}}, "serverName": "kvtier-sidecar"}
    plain = render({**on, "controlTls": {"enabled": False}}, extra=MONITORING_APIS)
    assert "scheme" not in plain[("PodMonitor", "kvtier-sidecars")]["spec"]["podMetricsEndpoints"][0]
    assert {r.get("targetLabel") for r in pm["podMetricsEndpoints"][0]["relabelings"]} >= {"policy", "namespace", "pod"}
    sm = objects[("ServiceMonitor", "kvtier-operator")]["spec"]
    assert sm["endpoints"][0]["honorLabels"] is True
    svc = objects[("Service", "kvtier-operator-metrics")]
    assert svc["spec"]["ports"][0]["port"] == 8090


def test_dashboard_configmap_has_grafana_label_and_a_query_per_panel():
    cm = render()[("ConfigMap", "kvtier-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["kvtier.json"])
    titles = [p["title"] for p in dash["panels"]]
    assert {"Fleet hit rate (loaded)", "Offered hits per tenant", "Prompt tokens loaded by tier", "Rollout step",
            "Canary hit rate against baseline", "Evictions", "Admission"} <= set(titles)
    assert all(p["targets"] and all(t["expr"] for t in p["targets"]) for p in dash["panels"])
    # The hit rate is what the engines loaded over their prompts; what lookups offered
    # is drawn beside it, labelled so, never as the hit rate.
    panels = {p["title"]: p for p in dash["panels"]}
    fleet = panels["Fleet hit rate (loaded)"]["targets"]
    assert fleet[0]["expr"].startswith("sum by (namespace, policy) (rate(kvtier_engine_loaded_tokens_total{")
    assert "/ sum by (namespace, policy) (rate(kvtier_engine_prompt_tokens_total{" in fleet[0]["expr"]
    assert [t["legendFormat"].rsplit(" ", 1)[1] for t in fleet] == ["loaded", "offered"]
    assert panels["Canary hit rate against baseline"]["targets"][0]["expr"].startswith("kvtier:hit_rate:ratio{")
    for title, panel in panels.items():
        for t in panel["targets"]:
            offered = any(m in t["expr"] for m in ("kvtier_hits_total", "kvtier_prefix_cache_hits_total"))
            assert not offered or "offered" in t["legendFormat"] + title.lower(), (title, t["expr"])
    assert render({"monitoring": {"dashboard": {"enabled": False}}}).get(("ConfigMap", "kvtier-dashboard")) is None


def test_bad_monitoring_values_are_rejected_naming_the_key():
    from helm_chart import helm, CHART
    out = helm("template", "kvtier", str(CHART), values={"monitoring": {"rules": {"window": "five minutes"}}},
               check=False)
    assert out.returncode != 0 and "window" in out.stderr
