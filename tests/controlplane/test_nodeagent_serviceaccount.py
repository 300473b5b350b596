"""The node agent standing in for the ServiceAccount admission plugin and for
kubelet's projected volumes: pure helpers, then a pod with a bound token on the real
apiserver; and per-pod directories short enough for Unix sockets."""
from __future__ import annotations

import base64
import json
import time

from kvtier_testenv.podenv import pod_dir_name
from kvtier_testenv.podvolumes import SERVICE_ACCOUNT_MOUNT_PATH, downward_files, with_service_account_volume

# sockaddr_un.sun_path on Linux: 108 bytes including the terminating NUL.
UNIX_PATH_MAX = 108


def _pod(**spec) -> dict:
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "u-1"},
            "spec": {"containers": [{"name": "a"}, {"name": "b", "volumeMounts": [{"name": "x", "mountPath": "/x"}]}],
                     **spec}}


def test_service_account_volume_is_added_to_every_container_like_the_admission_plugin():
    pod = with_service_account_volume(_pod(serviceAccountName="op"))
    [vol] = pod["spec"]["volumes"]
    assert vol["name"].startswith("kube-api-access-")
    sources = vol["projected"]["sources"]
    assert sources[0]["serviceAccountToken"]["path"] == "token"
    assert sources[1]["configMap"] == {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    assert sources[2]["downwardAPI"]["items"][0]["fieldRef"]["fieldPath"] == "metadata.namespace"
    for c in pod["spec"]["containers"]:
        assert {"name": vol["name"], "mountPath": SERVICE_ACCOUNT_MOUNT_PATH, "readOnly": True} in c["volumeMounts"]
    assert with_service_account_volume(_pod(serviceAccountName="op")) == pod, "deterministic per pod"


def test_service_account_volume_respects_opt_out_existing_mounts_and_unnamed_accounts():
    opted_out = _pod(serviceAccountName="op", automountServiceAccountToken=False)
    assert with_service_account_volume(opted_out) is opted_out
    unnamed = _pod()
    assert with_service_account_volume(unnamed) is unnamed
    own = _pod(serviceAccountName="op")
    own["spec"]["containers"][0]["volumeMounts"] = [{"name": "mine", "mountPath": SERVICE_ACCOUNT_MOUNT_PATH}]
    assert with_service_account_volume(own) is own


def test_downward_files_render_field_refs():
    files = downward_files([{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}},
                            {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}],
                           {"metadata": {"namespace": "ns", "labels": {"b": "2", "a": "1"}}})
    assert files == {"namespace": b"ns", "labels": b'a="1"\nb="2"'}


def test_pod_directories_keep_socket_paths_short_for_the_longest_names(node_agent_factory):
    agent = node_agent_factory()
    uid = "0" * 36
    # the sidecar's socket under its run volume, as the node agent lays it out
    socket = agent.workdir / pod_dir_name(uid) / "volumes" / "kvtier-run" / f"kvtier-kvt-{'f' * 16}.sock"
    assert len(str(socket).encode()) < UNIX_PATH_MAX - 20, str(socket)
    assert pod_dir_name(uid) != pod_dir_name("1" * 36)


def _claims(token: str) -> dict:
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


def test_pod_gets_a_bound_token_ca_and_namespace_in_its_projected_volume(kubectl, namespace, node_agent_factory):
    kubectl.run("create", "serviceaccount", "reader")
    deadline = time.monotonic() + 30  # the root-CA publisher fills each new namespace
    while not kubectl.get_json("configmaps")["items"] and time.monotonic() < deadline:
        time.sleep(0.1)
    script = ("import os,sys,time; d=sys.argv[1]; "
              "print('FILES', sorted(f for f in os.listdir(d) if not f.startswith('..')), os.environ['KUBERNETES_SERVICE_HOST'], flush=True); "
              "time.sleep(300)")
    kubectl.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "reader", "labels": {"app": "r"}},
                   "spec": {"serviceAccountName": "reader", "containers": [{
                       "name": "kvtier-sidecar", "image": "local", "command": ["python", "-c", script, SERVICE_ACCOUNT_MOUNT_PATH]}]}})
    agent = node_agent_factory(selector="app=r", service_account_tokens=True)
    agent.wait_ready(1)
    proc = agent.process(namespace, "reader")
    local = proc.argv[-1]
    assert local != SERVICE_ACCOUNT_MOUNT_PATH and local.startswith(str(agent.workdir))
    with open(f"{local}/token") as f:
        claims = _claims(f.read())
    assert claims["sub"] == f"system:serviceaccount:{namespace}:reader"
    assert claims["kubernetes.io"]["pod"]["name"] == "reader"
    with open(f"{local}/ca.crt") as f:
        assert "BEGIN CERTIFICATE" in f.read()
    deadline = time.monotonic() + 10
    while "FILES" not in agent.log(namespace, "reader") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "FILES ['ca.crt', 'namespace', 'token'] 127.0.0.1" in agent.log(namespace, "reader")
