"""A node agent standing in for kubelet: pods run as local processes on loopback.

There is no container runtime here, so the agent does what kubelet would do for the
containers we can run natively (by default the one named `kvtier-sidecar`):

    NodeAgent(kubeconfig, namespaces=["t-1"], selector="app=web")
      1. registers a Node (Ready) named `node_name`;
      2. binds each selected, unscheduled pod to it (pods/binding, as the scheduler);
      3. gives it a unique loopback IP (127.N.x.y, N from the process id), so several pods' processes can
         each bind the same port on their own address;
      4. materialises its volumes under a short per-pod directory (a hash of the pod
         uid, so Unix socket paths inside stay far below the 108-byte limit whatever
         the namespace and pod names): ConfigMap, Secret, downwardAPI and projected
         volumes (serviceAccountToken from the TokenRequest API, renewed at 80% of
         its lifetime as kubelet does; configMap; secret; downwardAPI) in kubelet's
         atomic `..data` symlink layout, kept in sync when the sources change;
         emptyDir (any medium) as a directory; hostPath as itself;
      5. starts each runnable container as a process: command+args from the spec,
         env resolved as kubelet would (values with $(VAR) expansion, downward API
         fieldRefs, configMapKeyRef/secretKeyRef, envFrom) plus
         KUBERNETES_SERVICE_HOST/PORT naming the (loopback) API server, every
         mountPath in command/args/env/workingDir rewritten to its local directory;
      6. reports status: Running, podIP, containerStatuses, Ready once each runnable
         container's readinessProbe (httpGet or tcpSocket against the pod IP) passes;
         other containers (an engine image we cannot run) count as running and ready;
         with `readinessGates`, Ready also needs each gate's pod condition True (as
         kubelet: the controller owning the gate sets it);
      7. on exit of a process, follows restartPolicy: Always restarts it (pod not
         Ready meanwhile, restartCount+1); otherwise the pod turns Failed/Succeeded;
      8. on deletion sends SIGTERM and, like kubelet, leaves the pod Terminating (its
         deletionTimestamp set, its processes still serving) until they exit or the
         pod's grace period (deletionGracePeriodSeconds, else
         terminationGracePeriodSeconds; capped at MAX_GRACE_S) ends in SIGKILL; then
         confirms the deletion with grace 0. The loop keeps running meanwhile. A pod
         that vanished or was replaced by a new uid is stopped at once (SHUTDOWN_GRACE_S).

With `service_account_tokens=True` the agent also stands in for the ServiceAccount
admission plugin the test control plane turns off (envtest's choice): a pod that names
its `serviceAccountName`, does not opt out (`automountServiceAccountToken: false`) and
mounts nothing at /var/run/secrets/kubernetes.io/serviceaccount gets the plugin's
`kube-api-access-*` projected volume (token, the `kube-root-ca.crt` ConfigMap's ca.crt, the namespace)
mounted there in every container. A local process cannot see that absolute path, so a
program finds the files where the path is rewritten (e.g. the operator's
`--service-account-dir=/var/run/secrets/kubernetes.io/serviceaccount` argument).

Known limit: the API server rejects loopback addresses in Endpoints/EndpointSlices
("may not be in the loopback range"), so a Service selecting these pods gets no
endpoints; find peers from the pods' status.podIP instead.

The reconcile loop is level-triggered: every `poll_s` it lists the selected pods and
drives each towards the state above. Tests use `wait_ready`, `process`, `log` and
`kill`. The parts live beside this module: `podenv` (environment, downward API, mount
rewriting, pod IPs), `podvolumes` (volumes and tokens), `kubeapi` (the REST client)
and `supervisor` (processes, probes, restarts, pod status).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kvtier_testenv.kubeapi import ApiError, ObjectLookup, RestClient
from kvtier_testenv.podenv import (
    PodSpecError, expand_vars, is_ready, next_pod_ip, now_rfc3339, pod_dir_name, pod_key, resolve_env, rewrite_paths,
)
from kvtier_testenv.podvolumes import VolumeSyncer, with_service_account_volume
from kvtier_testenv.supervisor import (
    SHUTDOWN_GRACE_S, ContainerProcess, PodRun, begin_stop, pod_status, spawn, stop_run, supervise,
)

DEFAULT_CONTAINERS = ("kvtier-sidecar",)
POLL_S = 0.2


class NodeAgent:
    """Runs the selected pods' runnable containers as local processes (see module doc).

    Invariant: every process the agent started belongs to a pod uid in `self._runs`;
    a pod that is deleted, replaced or terminal has no live process, and `stop()`
    leaves none at all.
    """

    def __init__(self, kubeconfig: Path | str, *, namespaces: Iterable[str] | None = None,
                 selector: str | None = None, containers: Iterable[str] = DEFAULT_CONTAINERS,
                 node_name: str | None = None, workdir: Path | None = None,
                 base_env: Mapping[str, str] | None = None,
                 entrypoints: Mapping[str, list[str]] | None = None,
                 poll_s: float = POLL_S, service_account_tokens: bool = False) -> None:
        self.rest = RestClient(kubeconfig)
        self.volumes = VolumeSyncer(self.rest)
        self.namespaces = list(namespaces) if namespaces is not None else None
        self.selector = selector or ""
        self.runnable = frozenset(containers)
        self.node_name = node_name or f"kvtier-node-{uuid.uuid4().hex[:6]}"
        # Short on purpose: Unix socket paths under it must stay below 108 bytes.
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="kvn-"))
        self.base_env = dict(base_env) if base_env is not None else self._default_env()
        self.entrypoints = dict(entrypoints or {})
        self.poll_s = poll_s
        self.service_account_tokens = service_account_tokens
        self._runs: dict[str, PodRun] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []

    @staticmethod
    def _default_env() -> dict[str, str]:
        """The agent's environment with this Python's bin dir first, so a pod whose
        command is `python` or `kvtier-sidecar` runs from the project's venv."""
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        env.pop("KUBECONFIG", None)
        return env

    # -- lifecycle --

    def start(self) -> "NodeAgent":
        self._register_node()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=f"node-agent-{self.node_name}", daemon=True)
        self._thread.start()
        return self

    def stop(self, delete_node: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        with self._lock:
            runs = list(self._runs.values())
            for run in runs:  # all at once: the grace periods overlap
                begin_stop(run, SHUTDOWN_GRACE_S)
            for run in runs:
                stop_run(run)
            self._runs.clear()
        if delete_node:
            with contextlib.suppress(ApiError, OSError):
                self.rest.request("DELETE", f"/api/v1/nodes/{self.node_name}")
        self.rest.close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "NodeAgent":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- API for tests --

    def wait_ready(self, count: int, namespace: str | None = None, selector: str | None = None,
                   timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Polls the API server until exactly `count` matching pods are Ready (and none
        other is still coming up or terminating); returns them sorted by name."""
        ns = namespace or (self.namespaces[0] if self.namespaces and len(self.namespaces) == 1 else None)
        path = f"/api/v1/namespaces/{ns}/pods" if ns else "/api/v1/pods"
        sel = self.selector if selector is None else selector
        deadline = time.monotonic() + timeout_s
        pods: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            self._raise_if_failed()
            pods = self.rest.get(path, labelSelector=sel)["items"]
            live = [p for p in pods if p["status"].get("phase") not in ("Succeeded", "Failed")]
            ready = [p for p in live if is_ready(p) and not p["metadata"].get("deletionTimestamp")]
            if len(ready) == count and len(live) == count:
                return sorted(ready, key=lambda p: p["metadata"]["name"])
            time.sleep(self.poll_s)
        summary = [(p["metadata"]["name"], p["status"].get("phase"), is_ready(p)) for p in pods]
        raise TimeoutError(f"{count} ready pods not reached within {timeout_s}s (selector "
                           f"{sel!r}); now (name, phase, ready): {summary}; agent errors: {self.errors[-5:]}")

    def process(self, namespace: str, name: str, container: str | None = None) -> ContainerProcess:
        """The local process of a pod's container (the only runnable one by default)."""
        with self._lock:
            runs = [r for r in self._runs.values() if r.namespace == namespace and r.name == name]
            if not runs:
                raise KeyError(f"pod {namespace}/{name} is not running on node {self.node_name}")
            run = runs[-1]
            if container is None:
                if len(run.containers) != 1:
                    raise KeyError(f"pod {namespace}/{name} runs {sorted(run.containers)}; name one")
                return next(iter(run.containers.values()))
            return run.containers[container]

    def pod_ip(self, namespace: str, name: str) -> str:
        with self._lock:
            for run in self._runs.values():
                if run.namespace == namespace and run.name == name:
                    return run.ip
        raise KeyError(f"pod {namespace}/{name} is not running on node {self.node_name}")

    def log(self, namespace: str, name: str, container: str | None = None) -> str:
        return self.process(namespace, name, container).log.read_text(errors="replace")

    def kill(self, namespace: str, name: str, container: str | None = None,
             sig: int = signal.SIGKILL) -> int:
        """Signals a pod's process (as a crash would); returns the pid signalled."""
        cp = self.process(namespace, name, container)
        if not cp.alive():
            raise ProcessLookupError(f"{namespace}/{name} {cp.name} is not running")
        os.killpg(cp.proc.pid, sig)
        return cp.proc.pid

    def pids(self) -> list[int]:
        with self._lock:
            return [c.pid for r in self._runs.values() for c in r.containers.values() if c.alive()]

    def _raise_if_failed(self) -> None:
        if self._thread is not None and not self._thread.is_alive() and not self._stop.is_set():
            raise RuntimeError(f"node agent loop died: {self.errors[-3:]}")

    # -- node --

    def _register_node(self) -> None:
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {
            "name": self.node_name,
            "labels": {"kubernetes.io/hostname": self.node_name, "kubernetes.io/os": "linux",
                       "kvtier.dev/node-agent": "true"}}}
        try:
            self.rest.request("POST", "/api/v1/nodes", node)
        except ApiError as e:
            if e.status != 409:
                raise
        capacity = {"cpu": "64", "memory": "512Gi", "pods": "250"}
        status = {"status": {
            "capacity": capacity, "allocatable": capacity,
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                          {"type": "Hostname", "address": self.node_name}],
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "kvtier node agent", "lastHeartbeatTime": now_rfc3339(),
                            "lastTransitionTime": now_rfc3339()}],
            "nodeInfo": {"kubeletVersion": "kvtier-node-agent", "operatingSystem": "linux",
                         "architecture": "amd64", "machineID": "", "systemUUID": "", "bootID": "",
                         "kernelVersion": "", "osImage": "", "containerRuntimeVersion": "",
                         "kubeProxyVersion": ""}}}
        self.rest.request("PATCH", f"/api/v1/nodes/{self.node_name}/status", status,
                          "application/merge-patch+json")

    # -- reconcile loop --

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.reconcile()
            except Exception as e:  # keep the node alive; the error is kept for wait_ready
                self.errors.append(f"{type(e).__name__}: {e}")
                del self.errors[:-50]
            self._stop.wait(self.poll_s)

    def _list_pods(self) -> list[dict[str, Any]]:
        paths = ([f"/api/v1/namespaces/{ns}/pods" for ns in self.namespaces]
                 if self.namespaces is not None else ["/api/v1/pods"])
        pods: list[dict[str, Any]] = []
        for path in paths:
            pods += self.rest.get(path, labelSelector=self.selector)["items"]
        return [p for p in pods if p["spec"].get("nodeName") in (None, "", self.node_name)]

    def reconcile(self) -> None:
        """One level-triggered pass over the selected pods."""
        pods = self._list_pods()
        seen = {p["metadata"]["uid"] for p in pods}
        with self._lock:
            for uid in [u for u in self._runs if u not in seen]:
                stop_run(self._runs.pop(uid))
        for pod in pods:
            try:
                self._reconcile_pod(pod)
            except ApiError as e:
                if e.status not in (404, 409):  # gone or changed under us: next pass
                    self.errors.append(f"{pod_key(pod)}: {e}")
            except PodSpecError as e:
                self.errors.append(f"{pod_key(pod)}: {e}")
                self._patch_status(pod, {"phase": "Pending", "conditions": [
                    {"type": "Ready", "status": "False", "reason": "CreateContainerConfigError",
                     "message": str(e)}]})

    def _reconcile_pod(self, pod: dict[str, Any]) -> None:
        meta, uid = pod["metadata"], pod["metadata"]["uid"]
        if meta.get("deletionTimestamp"):
            with self._lock:
                run = self._runs.get(uid)
            if run is not None:
                grace = meta.get("deletionGracePeriodSeconds")
                if grace is None:
                    grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
                begin_stop(run, grace)
                if time.monotonic() < run.kill_at and any(cp.alive() for cp in run.containers.values()):
                    return  # Terminating: the pod object stays until its processes exit
                with self._lock:
                    self._runs.pop(uid, None)
                stop_run(run)
            self._confirm_deletion(pod)
            return
        if not pod["spec"].get("nodeName"):
            self._bind(pod)
            return
        if self.service_account_tokens:
            pod = with_service_account_volume(pod)
        with self._lock:
            run = self._runs.get(uid)
        if run is None:
            if pod["status"].get("phase") in ("Succeeded", "Failed"):
                return
            run = self._new_run(pod)
        if run.phase in ("Succeeded", "Failed"):
            if run.last_status is None or run.last_status["phase"] != run.phase:
                self._patch_status(pod, pod_status(run, pod))
            return
        lookup = ObjectLookup(self.rest, run.namespace)
        if not self.volumes.sync(run, pod, lookup):
            return  # a required ConfigMap/Secret is missing: stay Pending
        if not run.containers:
            self._start_containers(run, pod, lookup)
        supervise(run, pod)
        self._patch_status(pod, pod_status(run, pod))

    def _bind(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        body = {"apiVersion": "v1", "kind": "Binding",
                "metadata": {"name": meta["name"], "uid": meta["uid"]},
                "target": {"apiVersion": "v1", "kind": "Node", "name": self.node_name}}
        self.rest.request("POST", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/binding", body)

    def _confirm_deletion(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                "preconditions": {"uid": meta["uid"]}}
        with contextlib.suppress(ApiError):
            self.rest.request("DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}", body)

    def _new_run(self, pod: dict[str, Any]) -> PodRun:
        meta = pod["metadata"]
        ip = pod["status"].get("podIP") if pod["spec"].get("nodeName") == self.node_name else None
        run = PodRun(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"],
                     ip=ip or next_pod_ip(), dir=self.workdir / pod_dir_name(meta["uid"]))
        run.dir.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._runs[run.uid] = run
        return run

    def _start_containers(self, run: PodRun, pod: dict[str, Any], lookup: ObjectLookup) -> None:
        # The downward API's status.podIP must be the address the process will get.
        pod.setdefault("status", {})["podIP"] = run.ip
        pod["status"]["podIPs"] = [{"ip": run.ip}]
        pod["status"]["hostIP"] = "127.0.0.1"
        # Resolve every container before starting any: a bad spec starts nothing.
        prepared = [self._prepare(run, pod, c, lookup) for c in pod["spec"]["containers"]
                    if c["name"] in self.runnable]
        for cp in prepared:
            run.containers[cp.name] = cp
            spawn(cp)
        run.phase = "Running"

    def _prepare(self, run: PodRun, pod: dict[str, Any], c: Mapping[str, Any],
                 lookup: ObjectLookup) -> ContainerProcess:
        mounts = self.volumes.mounts(run, pod, c)
        env = {k: rewrite_paths(v, mounts) for k, v in resolve_env(c, pod, lookup).items()}
        command = c.get("command") or self.entrypoints.get(c["name"])
        if not command:
            raise PodSpecError(f"container {c['name']!r} has no command (no image entrypoint here)")
        argv = [rewrite_paths(expand_vars(a, env), mounts) for a in [*command, *c.get("args", [])]]
        cwd = Path(rewrite_paths(c["workingDir"], mounts)) if c.get("workingDir") else run.dir
        # kubelet's service environment for the `kubernetes` Service: here the API
        # server itself, on loopback, so in-cluster clients reach it.
        service_env = {"KUBERNETES_SERVICE_HOST": self.rest.host, "KUBERNETES_SERVICE_PORT": str(self.rest.port),
                       "KUBERNETES_SERVICE_PORT_HTTPS": str(self.rest.port)}
        full_env = {**self.base_env, "HOSTNAME": run.name, **service_env, **env}
        return ContainerProcess(c["name"], argv, full_env, cwd, run.dir / f"{c['name']}.log")

    def _patch_status(self, pod: dict[str, Any], status: dict[str, Any]) -> None:
        with self._lock:
            run = self._runs.get(pod["metadata"]["uid"])
        if run is not None and run.last_status == status:
            return
        stamped = json.loads(json.dumps(status))
        for cond in stamped.get("conditions", []):
            cond["lastTransitionTime"] = now_rfc3339()
            cond.setdefault("lastProbeTime", None)
        meta = pod["metadata"]
        # Strategic merge, as kubelet's status updates: conditions merge by type, so a
        # readiness gate's condition another writer (the operator) set stays.
        self.rest.request("PATCH", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                          {"metadata": {"uid": meta["uid"]}, "status": stamped},
                          "application/strategic-merge-patch+json")
        if run is not None:
            run.last_status = status
