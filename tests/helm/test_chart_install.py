"""charts/kvtier against the real kube-apiserver: `helm install` creates the CRD and
every object, `helm upgrade` keeps the webhook certificate, `helm uninstall` removes
what it made; and the operator Deployment from the chart, run by the node agent as a
local process with its own ServiceAccount token, reconciles a KVCachePolicy and
injects sidecars through the chart's webhook."""
from __future__ import annotations

import base64
import json
import re
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from helm_chart import CHART, ROOT, SA_DIR
from kvtier_testenv import polling
from kvtier_testenv.ports import free_port
from kvtier_testenv.kubectl import Kubectl, KubectlError

CRD_NAME = "kvcachepolicies.kvtier.io"


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    return polling.wait_for(what, probe, timeout_s, interval_s=0.2)


def exists(kubectl: Kubectl, *what: str) -> bool:
    try:
        kubectl.get_json(*what)
        return True
    except KubectlError as e:
        if "NotFound" in e.stderr or "not found" in e.stderr:
            return False
        raise


def only_namespace(name: str) -> dict[str, Any]:
    """Keeps a test's webhook from seeing other tests' pods on the shared apiserver."""
    return {"matchLabels": {"kubernetes.io/metadata.name": name}}


def test_install_creates_everything_upgrade_keeps_the_cert_uninstall_removes_it(helm, kubectl, namespace):
    release = f"kvt-{uuid.uuid4().hex[:6]}"
    name = f"{release}-kvtier"
    values = {"webhook": {"namespaceSelector": only_namespace(namespace)}}
    helm.install(release, CHART, values=values)
    cluster = kubectl.in_namespace(None)  # cluster-scoped objects
    try:
        crd = wait_for("the CRD Established", lambda: next(
            (c for c in cluster.get_json("crd", CRD_NAME)["status"].get("conditions", [])
             if c["type"] == "Established" and c["status"] == "True"), None))
        assert crd
        for kind in ("serviceaccount", "deployment", "service"):
            assert exists(kubectl, kind, f"{name}-operator"), kind
        for kind in ("clusterrole", "clusterrolebinding"):
            assert exists(cluster, kind, f"{name}-operator"), kind
        secret = kubectl.get_json("secret", f"{name}-webhook-tls")
        hook = cluster.get_json("mutatingwebhookconfiguration", f"{name}-sidecar-injector")
        assert hook["webhooks"][0]["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
        assert hook["webhooks"][0]["clientConfig"]["service"]["namespace"] == namespace
        binding = cluster.get_json("clusterrolebinding", f"{name}-operator")
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": f"{name}-operator", "namespace": namespace}]

        helm.install(release, CHART, values={**values, "operator": {"verbose": True}})  # an upgrade
        after = kubectl.get_json("secret", f"{name}-webhook-tls")
        assert after["data"] == secret["data"], "an upgrade must keep the webhook's CA and certificate"
        hook_after = cluster.get_json("mutatingwebhookconfiguration", f"{name}-sidecar-injector")
        assert hook_after["webhooks"][0]["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
        args = kubectl.get_json("deployment", f"{name}-operator")["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--verbose" in args, "the upgrade itself was applied"

        helm.install(release, CHART, values={"webhook": {"namespaceSelector": only_namespace(namespace),
                                                         "url": "https://127.0.0.1:9443/inject-sidecar"}})
        moved = kubectl.get_json("secret", f"{name}-webhook-tls")
        assert moved["data"]["tls.crt"] != secret["data"]["tls.crt"], \
            "a certificate that no longer covers the webhook's host is reissued"
    finally:
        helm.run("uninstall", release, "--wait")
    for kind in ("serviceaccount", "deployment", "service"):
        assert not exists(kubectl, kind, f"{name}-operator"), kind
    assert not exists(kubectl, "secret", f"{name}-webhook-tls")
    for kind in ("clusterrole", "clusterrolebinding"):
        assert not exists(cluster, kind, f"{name}-operator"), kind
    assert not exists(cluster, "mutatingwebhookconfiguration", f"{name}-sidecar-injector")
    assert exists(cluster, "crd", CRD_NAME), "helm never deletes a chart's CRDs (policies would go with them)"


def _jwt_claims(token: str) -> dict[str, Any]:
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


def test_operator_from_the_chart_runs_with_its_own_token_and_reconciles(
        helm, kubectl, namespace, control_plane, node_agent_factory):
    serving = f"{namespace[:50]}-srv"
    admin = Kubectl(control_plane.kubeconfig)
    admin.run("create", "namespace", serving)
    release = f"kvt-{uuid.uuid4().hex[:6]}"
    name = f"{release}-kvtier"
    webhook_port = free_port()
    values = {
        "operator": {"watchNamespaces": [serving], "healthPort": free_port()},
        "webhook": {"url": f"https://127.0.0.1:{webhook_port}/inject-sidecar", "port": webhook_port,
                    "namespaceSelector": only_namespace(serving)},
    }
    try:
        helm.install(release, CHART, values=values)
        agent = node_agent_factory(namespaces=[namespace], containers=("operator",), service_account_tokens=True,
                                   selector=f"app.kubernetes.io/instance={release}")
        [pod] = agent.wait_ready(1, timeout_s=90)
        proc = agent.process(namespace, pod["metadata"]["name"])
        sa_arg = next(a for a in proc.argv if a.startswith("--service-account-dir="))
        local_sa = sa_arg.split("=", 1)[1]
        assert local_sa != SA_DIR, "the mount path is rewritten to the pod's local volume"
        with open(f"{local_sa}/token") as f:
            claims = _jwt_claims(f.read())
        assert claims["sub"] == f"system:serviceaccount:{namespace}:{name}-operator"
        assert claims["kubernetes.io"]["pod"]["name"] == pod["metadata"]["name"], "a token bound to the pod"
        with open(f"{local_sa}/namespace") as f:
            assert f.read() == namespace
        assert proc.env["KUBERNETES_SERVICE_HOST"] == "127.0.0.1" and "KUBECONFIG" not in proc.env

        policy = (ROOT / "examples" / "minimal.yaml").read_text()
        kubectl.in_namespace(serving).apply(policy)
        tiers = wait_for("tier verdicts in the policy's status", lambda: kubectl.in_namespace(serving).get_json(
            "kvcp", "minimal").get("status", {}).get("tiers"), timeout_s=60)
        assert {t["tier"] for t in tiers} >= {"dram", "peer"}
        log = agent.log(namespace, pod["metadata"]["name"])
        assert f"membership of {serving}/minimal reconciled" in log, log[-3000:]
        assert "Handler 'spec_changed' succeeded" in log, log[-3000:]

        # The chart's webhook (URL mode) reaches the chart's operator, which injects.
        kubectl.in_namespace(serving).apply({"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": "web-0", "labels": {"app": "tiny-llm"}},
            "spec": {"containers": [{"name": "engine", "image": "example.com/engine:1"}]}})
        injected = kubectl.in_namespace(serving).get_json("pod", "web-0")
        assert [c["name"] for c in injected["spec"]["containers"]] == ["engine", "kvtier-sidecar"]
    finally:
        helm.run("uninstall", release, "--wait", check=False)
        admin.delete("namespace", serving, wait=False)


def test_install_with_bad_values_fails_with_the_schema_message_and_creates_nothing(helm, kubectl):
    release = f"kvt-{uuid.uuid4().hex[:6]}"
    try:
        helm.install(release, CHART, values={"webhook": {"failurePolicy": "Sometimes"}})
    except KubectlError as e:
        assert "at '/webhook/failurePolicy': value must be one of 'Ignore', 'Fail'" in e.stderr
    else:
        raise AssertionError("helm install accepted webhook.failurePolicy=Sometimes")
    assert helm.run("status", release, check=False).returncode != 0, "no release was recorded"
    assert not exists(kubectl, "serviceaccount", f"{release}-kvtier-operator")


def test_install_with_the_endpoint_picker_skips_the_pool_without_its_crd(helm, kubectl, namespace):
    """endpointPicker on, on an API server without the Gateway API Inference Extension's
    CRDs: the picker's objects are created, the InferencePool is left out (no failed
    install), and uninstall removes them."""
    release = f"kvt-{uuid.uuid4().hex[:6]}"
    epp = f"{release}-pool-epp"
    cluster = kubectl.in_namespace(None)
    has_crd = exists(cluster, "crd", "inferencepools.inference.networking.k8s.io")
    values = {"webhook": {"namespaceSelector": only_namespace(namespace)},
              "endpointPicker": {"enabled": True, "pools": [
                  {"name": f"{release}-pool", "policy": "llama", "selector": {"app": "vllm"}}]}}
    helm.install(release, CHART, values=values)
    try:
        for kind in ("serviceaccount", "role", "rolebinding", "configmap", "deployment", "service", "networkpolicy"):
            assert exists(kubectl, kind, epp), kind
        deployment = kubectl.get_json("deployment", epp)
        assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == epp
        manifest = helm.run("get", "manifest", release).stdout
        assert ("kind: InferencePool" in manifest) == has_crd
    finally:
        helm.run("uninstall", release, "--wait")
    for kind in ("serviceaccount", "role", "configmap", "deployment", "service"):
        assert not exists(kubectl, kind, epp), kind


def _gie_crds() -> list[Path]:
    """The Gateway API Inference Extension's CRDs, from the module router/epp pins (in Go's
    module cache; [] when it is not there)."""
    version = re.search(r"sigs\.k8s\.io/gateway-api-inference-extension (v\S+)",
                        (ROOT / "router" / "epp" / "go.mod").read_text()).group(1)
    try:
        cache = subprocess.run(["go", "env", "GOMODCACHE"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return []
    return sorted((Path(cache) / f"sigs.k8s.io/gateway-api-inference-extension@{version}/config/crd/bases").glob("*.yaml"))


def test_install_with_the_endpoint_picker_creates_the_pool_where_its_crd_is_served(helm, kubectl, namespace):
    """With the GIE CRDs installed, `inferencePool: auto` finds the API and creates the
    InferencePool, which the CRD's own schema accepts."""
    crds = _gie_crds()
    if not crds:
        pytest.fail("the GIE module is not in Go's module cache: scripts/setup.sh downloads it "
                    "(cd router/epp && go mod download sigs.k8s.io/gateway-api-inference-extension)")
    cluster = kubectl.in_namespace(None)
    created = []
    for crd in crds:
        name = yaml.safe_load(crd.read_text())["metadata"]["name"]
        if not exists(cluster, "crd", name):
            cluster.run("apply", "--server-side", "-f", str(crd))
            created.append(name)
    release = f"kvt-{uuid.uuid4().hex[:6]}"
    pool = f"{release}-pool"
    try:
        wait_for("InferencePools served", lambda: kubectl.run("get", "inferencepools.inference.networking.k8s.io",
                                                               check=False).returncode == 0)
        values = {"webhook": {"namespaceSelector": only_namespace(namespace)},
                  "endpointPicker": {"enabled": True, "pools": [
                      {"name": pool, "policy": "llama", "selector": {"app": "vllm"}, "targetPort": 8001}]}}
        helm.install(release, CHART, values=values)
        try:
            spec = kubectl.get_json("inferencepools.inference.networking.k8s.io", pool)["spec"]
            assert spec["selector"]["matchLabels"] == {"app": "vllm"}
            assert spec["targetPorts"] == [{"number": 8001}]
            assert (spec["endpointPickerRef"]["name"], spec["endpointPickerRef"]["port"]) == (
                f"{pool}-epp", {"number": 9002})
        finally:
            helm.run("uninstall", release, "--wait")
        assert not exists(kubectl, "inferencepools.inference.networking.k8s.io", pool)
    finally:
        for name in created:  # leave the shared API server as it was
            cluster.run("delete", "crd", name, "--wait=false", check=False)
