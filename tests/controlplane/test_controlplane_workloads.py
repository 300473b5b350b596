"""Workload controllers + the node agent: pods are created by kube-controller-manager
and run by the agent as local processes on their own loopback IPs."""
from __future__ import annotations

import json
import os
import signal
import urllib.request
from collections.abc import Callable

from kvtier_testenv.kubectl import Kubectl
from kvtier_testenv import polling
from kvtier_testenv.nodeagent import NodeAgent
from kvtier_testenv.podenv import is_ready

WAIT_S = 60.0


def poll(what: str, check: Callable[[], object], timeout_s: float = WAIT_S) -> object:
    """Returns check()'s first truthy value; fails naming `what` after the deadline."""
    return polling.wait_for(what, check, timeout_s)


def statefulset(replicas: int) -> dict:
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "web"},
        "spec": {
            "replicas": replicas, "serviceName": "web",
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "terminationGracePeriodSeconds": 2,
                    "containers": [
                        {
                            "name": "kvtier-sidecar", "image": "kvtier/sidecar:dev",
                            "command": ["python", "-m", "http.server", "--bind", "$(POD_IP)", "8080"],
                            "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                            "ports": [{"name": "http", "containerPort": 8080}],
                            "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
                        },
                        # An engine container we cannot run locally: nominally running.
                        {"name": "engine", "image": "vllm/vllm-openai:latest"},
                    ],
                },
            },
        },
    }


def http_ok(ip: str, port: int) -> bool:
    with urllib.request.urlopen(f"http://{ip}:{port}/", timeout=5) as resp:
        return resp.status == 200


def test_statefulset_scaled_0_3_1_runs_and_stops_local_processes(kubectl: Kubectl, node_agent: NodeAgent,
                                                                  namespace: str) -> None:
    kubectl.apply(statefulset(0))
    assert kubectl.get_json("pods")["items"] == []

    kubectl.scale("statefulset/web", 3)
    pods = node_agent.wait_ready(3, selector="app=web")
    assert [p["metadata"]["name"] for p in pods] == ["web-0", "web-1", "web-2"]
    ips = [p["status"]["podIP"] for p in pods]
    assert len(set(ips)) == 3 and all(ip.startswith("127.") for ip in ips)
    assert all(p["spec"]["nodeName"] == node_agent.node_name for p in pods)
    # Each pod's process listens on the same port, on its own IP.
    assert all(http_ok(ip, 8080) for ip in ips)
    procs = {p["metadata"]["name"]: node_agent.process(namespace, p["metadata"]["name"]) for p in pods}
    assert all(proc.alive() for proc in procs.values())
    poll("statefulset readyReplicas=3",
         lambda: kubectl.get_json("statefulset", "web")["status"].get("readyReplicas") == 3)

    kubectl.scale("statefulset/web", 1)
    pods = node_agent.wait_ready(1, selector="app=web")
    assert [p["metadata"]["name"] for p in pods] == ["web-0"]
    poll("pods web-1, web-2 gone", lambda: len(kubectl.get_json("pods")["items"]) == 1)
    assert not procs["web-1"].alive() and not procs["web-2"].alive()
    assert procs["web-0"].alive() and http_ok(ips[0], 8080)
    poll("statefulset readyReplicas=1",
         lambda: kubectl.get_json("statefulset", "web")["status"].get("readyReplicas") == 1)


SCRIPT = """
import json, os, sys, time
keys = ["POD_NAME", "POD_NAMESPACE", "POD_IP", "WEIGHTS_VERSION", "MODE", "SOCKET_DIR"]
print("ENV " + json.dumps({k: os.environ.get(k) for k in keys}), flush=True)
print("ARGV " + json.dumps(sys.argv[1:]), flush=True)
print("SOCKET_DIR_EXISTS " + str(os.path.isdir(os.environ["SOCKET_DIR"])), flush=True)
last = None
while True:
    try:
        cur = open(sys.argv[1]).read()
    except OSError as e:
        cur = "ERR " + str(e)
    if cur != last:
        print("CONFIG " + json.dumps(cur), flush=True)
        last = cur
    time.sleep(0.05)
"""


def sidecar_pod() -> dict:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "sc", "labels": {"app": "sc", "kvtier.dev/weights-version": "sha256-abc"}},
        "spec": {
            "terminationGracePeriodSeconds": 2,
            "containers": [{
                "name": "kvtier-sidecar", "image": "kvtier/sidecar:dev",
                "command": ["python", "-c", SCRIPT],
                "args": ["/etc/kvtier/sidecar.yaml", "$(POD_NAME)"],
                "env": [
                    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    {"name": "WEIGHTS_VERSION", "valueFrom": {"fieldRef": {
                        "fieldPath": "metadata.labels['kvtier.dev/weights-version']"}}},
                    {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "sidecar-cfg", "key": "mode"}}},
                    {"name": "SOCKET_DIR", "value": "/var/run/kvtier"},
                ],
                "volumeMounts": [
                    {"name": "cfg", "mountPath": "/etc/kvtier"},
                    {"name": "run", "mountPath": "/var/run/kvtier"},
                ],
            }],
            "volumes": [
                {"name": "cfg", "configMap": {"name": "sidecar-cfg",
                                              "items": [{"key": "sidecar.yaml", "path": "sidecar.yaml"}]}},
                {"name": "run", "emptyDir": {"medium": "Memory"}},
            ],
        },
    }


def log_lines(agent: NodeAgent, namespace: str, prefix: str) -> list[str]:
    try:
        text = agent.log(namespace, "sc")
    except KeyError:
        return []
    return [line[len(prefix) + 1:] for line in text.splitlines() if line.startswith(prefix + " ")]


def test_pod_gets_downward_env_configmap_volume_and_sees_configmap_updates(
        kubectl: Kubectl, node_agent: NodeAgent, namespace: str) -> None:
    kubectl.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "sidecar-cfg"},
                   "data": {"mode": "fast", "sidecar.yaml": "capacity_bytes: 1\n"}})
    kubectl.apply(sidecar_pod())
    (pod,) = node_agent.wait_ready(1, selector="app=sc")
    env = json.loads(poll("ENV line", lambda: log_lines(node_agent, namespace, "ENV"))[0])
    local_run = env.pop("SOCKET_DIR")
    assert env == {"POD_NAME": "sc", "POD_NAMESPACE": namespace, "POD_IP": pod["status"]["podIP"],
                   "WEIGHTS_VERSION": "sha256-abc", "MODE": "fast"}
    assert local_run != "/var/run/kvtier" and local_run.endswith("/volumes/run")
    assert log_lines(node_agent, namespace, "SOCKET_DIR_EXISTS") == ["True"]
    argv = json.loads(log_lines(node_agent, namespace, "ARGV")[0])
    assert argv[0].endswith("/volumes/cfg/sidecar.yaml") and argv[1] == "sc"
    poll("first config", lambda: json.dumps("capacity_bytes: 1\n") in log_lines(node_agent, namespace, "CONFIG"))

    kubectl.run("patch", "configmap", "sidecar-cfg", "--type=merge",
                "-p", '{"data":{"sidecar.yaml":"capacity_bytes: 2\\n"}}')
    seen = poll("updated config", lambda: (lines := log_lines(node_agent, namespace, "CONFIG"))
                and lines[-1] == json.dumps("capacity_bytes: 2\n") and lines)
    # The atomic swap means the reader never saw a missing or partial file.
    assert not any(line.startswith('"ERR') for line in seen)


def test_killed_process_restarts_under_restart_policy_always(kubectl: Kubectl, node_agent: NodeAgent,
                                                             namespace: str) -> None:
    kubectl.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "sidecar-cfg"},
                   "data": {"mode": "slow", "sidecar.yaml": "x: 1\n"}})
    kubectl.apply(sidecar_pod())
    node_agent.wait_ready(1, selector="app=sc")
    first = node_agent.process(namespace, "sc")
    old_pid = node_agent.kill(namespace, "sc", sig=signal.SIGKILL)
    poll("pod not Ready after the crash", lambda: not is_ready(kubectl.get_json("pod", "sc")))
    poll("restartCount 1 and Ready again", lambda: (p := kubectl.get_json("pod", "sc"))
         and is_ready(p) and p["status"]["containerStatuses"][0]["restartCount"] == 1)
    assert first.pid != old_pid and first.alive()

    kubectl.run("delete", "pod", "sc", "--wait=true", "--timeout=60s")
    assert not first.alive()
    assert kubectl.get_json("pods")["items"] == []


def test_agent_leaves_pods_outside_its_selector_unscheduled(
        kubectl: Kubectl, node_agent_factory: Callable[..., NodeAgent], namespace: str) -> None:
    agent = node_agent_factory(selector="app=web", containers=["main"])
    for name, app in (("mine", "web"), ("other", "db")):
        kubectl.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": app}},
                       "spec": {"containers": [{"name": "main", "image": "x",
                                                "command": ["python", "-c", "import time; time.sleep(600)"]}]}})
    agent.wait_ready(1, selector="app=web")
    other = kubectl.get_json("pod", "other")
    assert other["spec"].get("nodeName") is None and other["status"]["phase"] == "Pending"
    assert os.path.exists(f"/proc/{agent.process(namespace, 'mine').pid}")


def test_killed_process_fails_the_pod_under_restart_policy_never(
        kubectl: Kubectl, node_agent_factory: Callable[..., NodeAgent], namespace: str) -> None:
    agent = node_agent_factory(containers=["main"])
    kubectl.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "once", "labels": {"app": "once"}},
                   "spec": {"restartPolicy": "Never", "containers": [{
                       "name": "main", "image": "x", "command": ["python", "-c", "import time; time.sleep(600)"]}]}})
    agent.wait_ready(1, selector="app=once")
    agent.kill(namespace, "once", sig=signal.SIGTERM)
    pod = poll("pod Failed", lambda: (p := kubectl.get_json("pod", "once"))["status"]["phase"] == "Failed" and p)
    assert not is_ready(pod)
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 128 + signal.SIGTERM and terminated["reason"] == "Error"
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0


def test_a_readiness_gate_holds_the_pod_out_until_its_condition_is_true_and_survives_the_agents_writes(
        kubectl: Kubectl, node_agent_factory: Callable[..., NodeAgent], namespace: str) -> None:
    """As kubelet: Ready only when the containers are and every readiness gate's
    condition (another controller's to set, via pods/status) is True; the agent's own
    status writes merge conditions by type, so the gate's condition stays."""
    agent = node_agent_factory(containers=["main"])
    kubectl.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "gated", "labels": {"app": "gated"}},
                   "spec": {"readinessGates": [{"conditionType": "example.com/warm"}],
                            "containers": [{"name": "main", "image": "x",
                                            "command": ["python", "-c", "import time; time.sleep(600)"]}]}})

    def conditions() -> dict[str, dict]:
        return {c["type"]: c for c in kubectl.get_json("pod", "gated")["status"].get("conditions") or []}

    poll("containers ready", lambda: conditions().get("ContainersReady", {}).get("status") == "True")
    held = conditions()
    assert held["Ready"]["status"] == "False" and held["Ready"]["reason"] == "ReadinessGatesNotReady"

    def set_gate(status: str) -> None:
        kubectl.run("patch", "pod", "gated", "--subresource=status", "--type=strategic", "-p", json.dumps(
            {"status": {"conditions": [{"type": "example.com/warm", "status": status, "reason": "Test"}]}}))

    set_gate("False")
    poll("the False gate seen", lambda: conditions().get("example.com/warm", {}).get("status") == "False")
    assert conditions()["Ready"]["status"] == "False"
    set_gate("True")
    ready = poll("Ready once the gate is True", lambda: (c := conditions())["Ready"]["status"] == "True" and c)
    assert ready["example.com/warm"]["status"] == "True" and "reason" not in ready["Ready"]
    agent.kill(namespace, "gated", sig=signal.SIGKILL)  # the agent rewrites the status: the gate stays
    poll("restarted", lambda: kubectl.get_json("pod", "gated")["status"]["containerStatuses"][0]["restartCount"] >= 1)
    after = poll("Ready again", lambda: (c := conditions())["Ready"]["status"] == "True" and c)
    assert after["example.com/warm"]["status"] == "True"
