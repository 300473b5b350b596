"""Objects round-trip through the real kube-apiserver via the real kubectl."""
from __future__ import annotations

import time

import pytest

from kvtier_testenv.controlplane import ControlPlane
from kvtier_testenv.kubectl import Kubectl, KubectlError

GROUP = "harness.kvtier.dev"
CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"widgets.{GROUP}"},
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "versions": [{
            "name": "v1", "served": True, "storage": True,
            "subresources": {"status": {}},
            "schema": {"openAPIV3Schema": {
                "type": "object",
                "properties": {
                    "spec": {"type": "object", "required": ["replicas"], "properties": {
                        "replicas": {"type": "integer", "minimum": 1, "maximum": 8},
                        "model": {"type": "string"},
                    }},
                    "status": {"type": "object", "properties": {"phase": {"type": "string"}}},
                },
            }},
        }],
    },
}
# Applying a CRD returns before its REST endpoint serves; this bounds the wait.
CRD_ESTABLISHED_TIMEOUT_S = 30


def widget(name: str, replicas: object) -> dict:
    return {"apiVersion": f"{GROUP}/v1", "kind": "Widget", "metadata": {"name": name},
            "spec": {"replicas": replicas, "model": "llama-3-8b"}}


@pytest.fixture
def widget_crd(kubectl: Kubectl) -> Kubectl:
    kubectl.apply(CRD)
    kubectl.run("wait", "--for=condition=Established", f"crd/widgets.{GROUP}",
                f"--timeout={CRD_ESTABLISHED_TIMEOUT_S}s")
    return kubectl


def test_namespace_exists_and_configmap_round_trips(kubectl: Kubectl, namespace: str) -> None:
    ns = kubectl.get_json("namespace", namespace)
    assert ns["status"]["phase"] == "Active"
    kubectl.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"},
                   "data": {"sidecar.yaml": "block_size: 16\n"}})
    got = kubectl.get_json("configmap", "cfg")
    assert got["metadata"]["namespace"] == namespace
    assert got["data"] == {"sidecar.yaml": "block_size: 16\n"}
    kubectl.run("patch", "configmap", "cfg", "--type=merge", "-p", '{"data":{"sidecar.yaml":"block_size: 32\\n"}}')
    assert kubectl.get_json("configmap", "cfg")["data"]["sidecar.yaml"] == "block_size: 32\n"


def test_crd_and_custom_resource_round_trip_with_status_subresource(widget_crd: Kubectl) -> None:
    widget_crd.apply(widget("w1", 3))
    got = widget_crd.get_json("widget", "w1")
    assert got["spec"] == {"replicas": 3, "model": "llama-3-8b"}
    # status is a subresource: a main-resource write ignores it, --subresource=status applies it.
    widget_crd.run("patch", "widget", "w1", "--type=merge", "-p", '{"status":{"phase":"Ready"}}')
    assert "status" not in widget_crd.get_json("widget", "w1")
    widget_crd.run("patch", "widget", "w1", "--subresource=status", "--type=merge", "-p", '{"status":{"phase":"Ready"}}')
    assert widget_crd.get_json("widget", "w1")["status"] == {"phase": "Ready"}
    widget_crd.delete("widget", "w1", wait=True)
    with pytest.raises(KubectlError, match="NotFound|not found"):
        widget_crd.get_json("widget", "w1")


def test_schema_violation_is_rejected_with_the_servers_message(widget_crd: Kubectl) -> None:
    with pytest.raises(KubectlError) as err:
        widget_crd.apply(widget("too-many", 99))
    message = str(err.value)
    assert "spec.replicas" in message and "less than or equal to 8" in message
    with pytest.raises(KubectlError, match=r"spec.replicas: Invalid value: \"string\""):
        widget_crd.apply(widget("wrong-type", "three"))
    # Nothing was stored by the rejected writes.
    assert widget_crd.get_json("widgets")["items"] == []


def test_service_account_token_is_subject_to_rbac(control_plane: ControlPlane, kubectl: Kubectl,
                                                   namespace: str) -> None:
    kubectl.run("create", "serviceaccount", "op")
    as_op = Kubectl(control_plane.kubeconfig_for_service_account(namespace, "op"), namespace=namespace)
    with pytest.raises(KubectlError, match="forbidden"):
        as_op.get_json("configmaps")
    kubectl.run("create", "role", "read-cm", "--verb=get,list", "--resource=configmaps")
    kubectl.run("create", "rolebinding", "op-read-cm", "--role=read-cm", f"--serviceaccount={namespace}:op")
    deadline = time.monotonic() + 10  # the RBAC authorizer's informer catches up
    while True:
        try:
            assert isinstance(as_op.get_json("configmaps")["items"], list)
            break
        except KubectlError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    with pytest.raises(KubectlError, match="forbidden"):
        as_op.get_json("secrets")


def test_client_certificate_user_without_bindings_is_forbidden(control_plane: ControlPlane,
                                                               namespace: str) -> None:
    nobody = Kubectl(control_plane.kubeconfig_for_user("alice", ("dev",)), namespace=namespace)
    with pytest.raises(KubectlError, match='User "alice" cannot list resource "pods"'):
        nobody.get_json("pods")


def test_python_client_sees_the_same_cluster(api_client, namespace: str) -> None:
    from kubernetes import client

    names = [n.metadata.name for n in client.CoreV1Api(api_client).list_namespace().items]
    assert namespace in names and "kube-system" in names


def test_helm_installs_a_chart_into_the_test_namespace(helm, kubectl: Kubectl, tmp_path) -> None:
    chart = tmp_path / "tiny"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: tiny\nversion: 0.1.0\nkubeVersion: '>=1.33.0-0'\n")
    (chart / "values.yaml").write_text("blockSize: 16\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-cfg\n"
        "data:\n  block_size: {{ .Values.blockSize | quote }}\n")
    helm.install("r1", chart, values={"blockSize": 32})
    assert kubectl.get_json("configmap", "r1-cfg")["data"] == {"block_size": "32"}
    assert "r1" in helm.run("list", "--short").stdout.split()
