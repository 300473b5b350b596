"""A node agent standing in for kubelet: pods run as local processes on loopback.

There is no container runtime here, so the agent does what kubelet would do for the
containers we can run natively (by default the one named `kvtier-sidecar`):

    NodeAgent(kubeconfig, namespaces=["t-1"], selector="app=web")
      1. registers a Node (Ready) named `node_name`;
      2. binds each selected, unscheduled pod to it (pods/binding, as the scheduler);
      3. gives it a unique loopback IP (127.1.x.y), so several pods' processes can
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
`kill`. Pure helpers (env, mount rewriting, status) are module functions at the top.
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import itertools
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

DEFAULT_CONTAINERS = ("kvtier-sidecar",)
POLL_S = 0.2
# kubelet syncs volumes every ~60 s; tests want a ConfigMap edit visible in seconds.
VOLUME_SYNC_S = 1.0
# kubelet probes every periodSeconds (default 10 s); tests cannot wait that long.
MAX_PROBE_PERIOD_S = 1.0
# kubelet's crash back-off starts at 10 s; one second keeps restart tests quick.
RESTART_BACKOFF_S = 1.0
# Cap on a pod's grace period: a draining sidecar needs its (default 30 s) grace, and
# the loop keeps serving other pods meanwhile, so only a stuck process waits this long.
MAX_GRACE_S = 60.0
# Grace for processes of pods that vanished, and for all of them when the agent stops
# (a test's teardown): short, so a stuck process cannot stall a test.
SHUTDOWN_GRACE_S = 5.0
HTTP_TIMEOUT_S = 10.0
# kubelet renews a projected token once 80% of its lifetime has passed.
TOKEN_RENEW_FRACTION = 0.8
# What the ServiceAccount admission plugin asks for (3607 s: one hour plus the
# plugin's marker seconds, which extend a legacy-style token's validity).
SERVICE_ACCOUNT_TOKEN_EXPIRATION_S = 3607
SERVICE_ACCOUNT_MOUNT_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
ROOT_CA_CONFIG_MAP = "kube-root-ca.crt"
# Per-pod directories are named by this many hex digits of a hash of the pod uid.
POD_DIR_HASH_CHARS = 10
# Pod IPs come from 127.1.0.0/16, away from 127.0.0.1 that servers in tests use.
_POD_IPS = (f"127.1.{i // 254}.{i % 254 + 1}" for i in itertools.count(1))
_POD_IPS_LOCK = threading.Lock()
_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


def next_pod_ip() -> str:
    """A loopback address no other pod of this Python process has had."""
    with _POD_IPS_LOCK:
        return next(_POD_IPS)


class PodSpecError(ValueError):
    """The pod cannot be started as written (e.g. a required ConfigMap key is missing)."""


# --- pure helpers ---------------------------------------------------------------------


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def expand_vars(text: str, env: Mapping[str, str]) -> str:
    """kubelet's $(VAR) expansion: defined names are replaced, $$ is a literal $,
    undefined references stay as written."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _VAR_REF.sub(sub, text)


def field_ref(pod: Mapping[str, Any], path: str) -> str:
    """The downward API value of `path` (metadata.name, metadata.labels['k'], ...)."""
    meta, spec, status = pod["metadata"], pod.get("spec", {}), pod.get("status", {})
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return str(meta.get(m.group(1), {}).get(m.group(2), ""))
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": status.get("podIP", ""),
        "status.hostIP": status.get("hostIP", ""),
    }
    if path in simple:
        return str(simple[path])
    if path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(path.split(".")[1], {})
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
    if path == "status.podIPs":
        return ",".join(p["ip"] for p in status.get("podIPs", []))
    raise PodSpecError(f"unsupported downward API fieldPath {path!r}")


def resolve_env(container: Mapping[str, Any], pod: Mapping[str, Any],
                lookup: "ObjectLookup") -> dict[str, str]:
    """The container's environment as kubelet builds it: envFrom first, then env in
    order, each value $(VAR)-expanded against what came before."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        prefix = source.get("prefix", "")
        for kind in ("configMapRef", "secretRef"):
            ref = source.get(kind)
            if ref is None:
                continue
            data = lookup.data("ConfigMap" if kind == "configMapRef" else "Secret", ref["name"])
            if data is None:
                if ref.get("optional"):
                    continue
                raise PodSpecError(f"envFrom {kind} {ref['name']!r} not found")
            env.update({prefix + k: v for k, v in data.items()})
    for var in container.get("env", []):
        name = var["name"]
        if "valueFrom" not in var:
            env[name] = expand_vars(var.get("value", ""), env)
            continue
        src = var["valueFrom"]
        if "fieldRef" in src:
            env[name] = field_ref(pod, src["fieldRef"]["fieldPath"])
        elif "configMapKeyRef" in src or "secretKeyRef" in src:
            kind = "ConfigMap" if "configMapKeyRef" in src else "Secret"
            ref = src.get("configMapKeyRef") or src["secretKeyRef"]
            data = lookup.data(kind, ref["name"])
            if data is None or ref["key"] not in data:
                if ref.get("optional"):
                    continue
                raise PodSpecError(f"env {name}: {kind} {ref['name']!r} key {ref['key']!r} not found")
            env[name] = data[ref["key"]]
        else:
            raise PodSpecError(f"env {name}: unsupported valueFrom {sorted(src)}")
    return env


def rewrite_paths(text: str, mounts: Mapping[str, Path]) -> str:
    """Replaces each mountPath (longest first, whole path components only) with its
    local directory."""
    for mount_path in sorted(mounts, key=len, reverse=True):
        pattern = re.escape(mount_path.rstrip("/")) + r"(?=$|[/\s:;,\"'=])"
        text = re.sub(pattern, lambda _m, p=str(mounts[mount_path]): p, text)
    return text


def pod_dir_name(uid: str) -> str:
    """A short, stable directory name for a pod (uids are unique; names can be long)."""
    return hashlib.sha256(uid.encode()).hexdigest()[:POD_DIR_HASH_CHARS]


def with_service_account_volume(pod: dict[str, Any]) -> dict[str, Any]:
    """What the ServiceAccount admission plugin adds to a pod: a `kube-api-access-*`
    projected volume mounted read-only at SERVICE_ACCOUNT_MOUNT_PATH in every
    container. Unchanged when the pod opts out, already mounts something there, or
    names no ServiceAccount: the plugin would have set `default`, and a token bound to
    a pod must name the pod's own account, which cannot be set after creation."""
    spec = pod.get("spec", {})
    if spec.get("automountServiceAccountToken") is False or not spec.get("serviceAccountName"):
        return pod
    containers = [*spec.get("initContainers", []), *spec.get("containers", [])]
    if any(m.get("mountPath") == SERVICE_ACCOUNT_MOUNT_PATH for c in containers for m in c.get("volumeMounts", [])):
        return pod
    out = json.loads(json.dumps(pod))
    name = f"kube-api-access-{pod_dir_name(pod['metadata'].get('uid', ''))[:5]}"
    out["spec"].setdefault("volumes", []).append({"name": name, "projected": {"defaultMode": 0o644, "sources": [
        {"serviceAccountToken": {"expirationSeconds": SERVICE_ACCOUNT_TOKEN_EXPIRATION_S, "path": "token"}},
        {"configMap": {"name": ROOT_CA_CONFIG_MAP, "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
    ]}})
    for key in ("initContainers", "containers"):
        for c in out["spec"].get(key, []):
            c.setdefault("volumeMounts", []).append(
                {"name": name, "mountPath": SERVICE_ACCOUNT_MOUNT_PATH, "readOnly": True})
    return out


def downward_files(items: Iterable[Mapping[str, Any]], pod: Mapping[str, Any]) -> dict[str, bytes]:
    """A downwardAPI volume's (or projection's) files: fieldRef items only."""
    out: dict[str, bytes] = {}
    for item in items:
        if "fieldRef" not in item:
            raise PodSpecError(f"downwardAPI item {item.get('path')!r}: only fieldRef is supported")
        out[item["path"]] = field_ref(pod, item["fieldRef"]["fieldPath"]).encode()
    return out


def pod_key(pod: Mapping[str, Any]) -> str:
    return f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"


def is_ready(pod: Mapping[str, Any]) -> bool:
    for cond in pod.get("status", {}).get("conditions", []):
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


# --- a minimal REST client (raw JSON: no model deserialisation in a 0.2 s loop) ---------


class ApiError(RuntimeError):
    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        self.status = status
        super().__init__(f"{method} {path} -> {status}: {body[:500]}")


class RestClient:
    """JSON over HTTPS with the credentials of a kubeconfig's current context."""

    def __init__(self, kubeconfig: Path | str) -> None:
        cfg = yaml.safe_load(Path(kubeconfig).read_text())
        ctx_name = cfg["current-context"]
        ctx = next(c["context"] for c in cfg["contexts"] if c["name"] == ctx_name)
        cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == ctx["cluster"])
        user = next(u["user"] for u in cfg["users"] if u["name"] == ctx["user"])
        url = urllib.parse.urlsplit(cluster["server"])
        self.host, self.port = url.hostname, url.port or 443
        self._tmp = Path(tempfile.mkdtemp(prefix="kvtier-rest-"))
        ca = self._file(cluster, "certificate-authority")
        self.ctx = ssl.create_default_context(cafile=ca)
        cert, key = self._file(user, "client-certificate"), self._file(user, "client-key")
        if cert and key:
            self.ctx.load_cert_chain(cert, key)
        self.headers = {"Accept": "application/json"}
        if user.get("token"):
            self.headers["Authorization"] = f"Bearer {user['token']}"
        self._local = threading.local()

    def _file(self, section: Mapping[str, Any], name: str) -> str | None:
        if section.get(name):
            return section[name]
        data = section.get(f"{name}-data")
        if not data:
            return None
        path = self._tmp / name
        path.write_bytes(base64.b64decode(data))
        return str(path)

    def _conn(self) -> http.client.HTTPSConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPSConnection(self.host, self.port, context=self.ctx, timeout=HTTP_TIMEOUT_S)
            self._local.conn = conn
        return conn

    def request(self, method: str, path: str, body: Any = None,
                content_type: str = "application/json") -> Any:
        payload = None if body is None else json.dumps(body).encode()
        headers = dict(self.headers)
        if payload is not None:
            headers["Content-Type"] = content_type
        for attempt in (0, 1):  # one retry on a dropped keep-alive connection
            conn = self._conn()
            try:
                conn.request(method, path, body=payload, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                break
            except (http.client.HTTPException, OSError):
                conn.close()
                self._local.conn = None
                if attempt:
                    raise
        if resp.status >= 400:
            raise ApiError(method, path, resp.status, data.decode(errors="replace"))
        return json.loads(data) if data else None

    def get(self, path: str, **query: str) -> Any:
        q = {k: v for k, v in query.items() if v}
        return self.request("GET", path + (f"?{urllib.parse.urlencode(q)}" if q else ""))

    def get_or_none(self, path: str) -> Any:
        try:
            return self.get(path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        shutil.rmtree(self._tmp, ignore_errors=True)


class ObjectLookup:
    """ConfigMap/Secret data of one namespace, fetched once per reconcile pass."""

    def __init__(self, rest: RestClient, namespace: str) -> None:
        self.rest, self.namespace = rest, namespace
        self._seen: dict[tuple[str, str], dict[str, Any] | None] = {}

    def object(self, kind: str, name: str) -> dict[str, Any] | None:
        key = (kind, name)
        if key not in self._seen:
            plural = "configmaps" if kind == "ConfigMap" else "secrets"
            self._seen[key] = self.rest.get_or_none(f"/api/v1/namespaces/{self.namespace}/{plural}/{name}")
        return self._seen[key]

    def data(self, kind: str, name: str) -> dict[str, str] | None:
        """String values; Secret data (base64) and ConfigMap binaryData decoded."""
        obj = self.object(kind, name)
        if obj is None:
            return None
        return {k: v.decode(errors="replace") for k, v in self.data_bytes(obj, kind).items()}

    @staticmethod
    def data_bytes(obj: Mapping[str, Any], kind: str) -> dict[str, bytes]:
        if kind == "Secret":
            out = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
            out.update({k: v.encode() for k, v in (obj.get("stringData") or {}).items()})
            return out
        out = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        out.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
        return out


# --- volumes ---------------------------------------------------------------------------


def write_atomic_volume(target: Path, files: Mapping[str, bytes], mode: int = 0o644) -> None:
    """kubelet's AtomicWriter layout: the payload lives in a timestamped directory,
    `..data` is a symlink to it swapped by rename, and each visible file is a
    symlink through `..data`; a reader never sees a half-written update."""
    target.mkdir(parents=True, exist_ok=True)
    stamp = target / f"..{datetime.now(timezone.utc).strftime('%Y_%m_%d_%H_%M_%S.%f')}"
    stamp.mkdir()
    for rel, content in files.items():
        path = stamp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        path.chmod(mode)
    old = os.readlink(target / "..data") if (target / "..data").is_symlink() else None
    tmp_link = target / "..data_tmp"
    with contextlib.suppress(FileNotFoundError):
        tmp_link.unlink()
    tmp_link.symlink_to(stamp.name)
    os.rename(tmp_link, target / "..data")
    tops = {rel.split("/", 1)[0] for rel in files}
    for top in tops:
        link = target / top
        if not link.is_symlink():
            link.symlink_to(f"..data/{top}")
    for entry in target.iterdir():
        if entry.is_symlink() and not entry.name.startswith("..") and entry.name not in tops:
            entry.unlink()
    if old:
        shutil.rmtree(target / old, ignore_errors=True)


def volume_files(vol: Mapping[str, Any], lookup: ObjectLookup) -> tuple[dict[str, bytes], int, str] | None:
    """(files, mode, resourceVersion) for a ConfigMap/Secret volume; None while a
    required object is missing (kubelet keeps the pod in ContainerCreating)."""
    if "configMap" in vol:
        src, kind, name = vol["configMap"], "ConfigMap", vol["configMap"].get("name", "")
    else:
        src, kind, name = vol["secret"], "Secret", vol["secret"].get("secretName", "")
    obj = lookup.object(kind, name)
    if obj is None:
        return ({}, 0o644, "absent") if src.get("optional") else None
    data = ObjectLookup.data_bytes(obj, kind)
    items = src.get("items")
    if items:
        missing = [i["key"] for i in items if i["key"] not in data]
        if missing and not src.get("optional"):
            raise PodSpecError(f"{kind} {name!r} lacks keys {missing} named by volume {vol['name']!r}")
        data = {i["path"]: data[i["key"]] for i in items if i["key"] in data}
    return data, src.get("defaultMode", 0o644), obj["metadata"]["resourceVersion"]


# --- per-pod state ---------------------------------------------------------------------


@dataclass(slots=True)
class ContainerProcess:
    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    log: Path
    proc: subprocess.Popen | None = None
    started_at: str = ""
    restart_count: int = 0
    exit_code: int | None = None
    finished_at: str = ""
    ready: bool = False
    probe_failures: int = 0
    next_probe: float = 0.0
    restart_after: float = 0.0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass(slots=True)
class PodRun:
    """What the agent runs for one pod uid."""

    namespace: str
    name: str
    uid: str
    ip: str
    dir: Path
    containers: dict[str, ContainerProcess] = field(default_factory=dict)
    volume_versions: dict[str, str] = field(default_factory=dict)
    # (volume, source index) -> (token, monotonic time to renew it)
    tokens: dict[tuple[str, int], tuple[str, float]] = field(default_factory=dict)
    next_volume_sync: float = 0.0
    phase: str = "Pending"
    message: str = ""
    last_status: dict[str, Any] | None = None
    start_time: str = field(default_factory=now_rfc3339)
    kill_at: float | None = None  # monotonic SIGKILL time once SIGTERM was sent


# --- the agent -------------------------------------------------------------------------


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
                self._begin_stop(run, SHUTDOWN_GRACE_S)
            for run in runs:
                self._stop_run(run)
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
                self._stop_run(self._runs.pop(uid))
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
                self._begin_stop(run, grace)
                if time.monotonic() < run.kill_at and any(cp.alive() for cp in run.containers.values()):
                    return  # Terminating: the pod object stays until its processes exit
                with self._lock:
                    self._runs.pop(uid, None)
                self._stop_run(run)
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
                self._patch_status(pod, self._status(run, pod))
            return
        lookup = ObjectLookup(self.rest, run.namespace)
        if not self._sync_volumes(run, pod, lookup):
            return  # a required ConfigMap/Secret is missing: stay Pending
        if not run.containers:
            self._start_containers(run, pod, lookup)
        self._supervise(run, pod)
        self._patch_status(pod, self._status(run, pod))

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

    # -- volumes and containers --

    def _volume_dir(self, run: PodRun, name: str) -> Path:
        return run.dir / "volumes" / name

    def _sync_volumes(self, run: PodRun, pod: dict[str, Any], lookup: ObjectLookup) -> bool:
        if time.monotonic() < run.next_volume_sync and run.containers:
            return True
        run.next_volume_sync = time.monotonic() + VOLUME_SYNC_S
        for vol in pod["spec"].get("volumes", []):
            target = self._volume_dir(run, vol["name"])
            if "configMap" in vol or "secret" in vol:
                got = volume_files(vol, lookup)
                if got is None:
                    if not run.containers:
                        run.message = f"waiting for volume {vol['name']!r}"
                        return False
                    continue  # deleted after start: kubelet keeps the last payload
                files, mode, version = got
                if run.volume_versions.get(vol["name"]) != version:
                    write_atomic_volume(target, files, mode)
                    run.volume_versions[vol["name"]] = version
            elif "projected" in vol or "downwardAPI" in vol:
                files = self._projected_files(run, pod, vol, lookup)
                if files is None:
                    if not run.containers:
                        run.message = f"waiting for volume {vol['name']!r}"
                        return False
                    continue
                version = hashlib.sha256(json.dumps(sorted((k, v.hex()) for k, v in files.items())).encode()).hexdigest()
                if run.volume_versions.get(vol["name"]) != version:
                    src = vol.get("projected") or vol["downwardAPI"]
                    write_atomic_volume(target, files, src.get("defaultMode", 0o644))
                    run.volume_versions[vol["name"]] = version
            elif "emptyDir" in vol:
                target.mkdir(parents=True, exist_ok=True)
            elif "hostPath" not in vol:
                raise PodSpecError(f"volume {vol['name']!r}: only configMap, secret, projected, downwardAPI, "
                                   "emptyDir and hostPath are supported")
        return True

    def _projected_files(self, run: PodRun, pod: dict[str, Any], vol: Mapping[str, Any],
                         lookup: ObjectLookup) -> dict[str, bytes] | None:
        """The files of a projected (or downwardAPI) volume; None while a required
        ConfigMap/Secret source is missing."""
        if "downwardAPI" in vol:
            return downward_files(vol["downwardAPI"].get("items", []), pod)
        files: dict[str, bytes] = {}
        for i, source in enumerate(vol["projected"].get("sources", [])):
            if "serviceAccountToken" in source:
                tok = source["serviceAccountToken"]
                files[tok["path"]] = self._token(run, pod, (vol["name"], i), tok).encode()
            elif "configMap" in source or "secret" in source:
                kind = "configMap" if "configMap" in source else "secret"
                src = dict(source[kind])
                as_volume = {"name": vol["name"],
                             kind: {**src, "secretName": src.get("name", "")} if kind == "secret" else src}
                got = volume_files(as_volume, lookup)
                if got is None:
                    return None
                files.update(got[0])
            elif "downwardAPI" in source:
                files.update(downward_files(source["downwardAPI"].get("items", []), pod))
            else:
                raise PodSpecError(f"volume {vol['name']!r}: unsupported projected source {sorted(source)}")
        return files

    def _token(self, run: PodRun, pod: dict[str, Any], key: tuple[str, int], source: Mapping[str, Any]) -> str:
        """A bound ServiceAccount token from the TokenRequest API, reused until 80% of
        its lifetime has passed."""
        cached = run.tokens.get(key)
        if cached is not None and time.monotonic() < cached[1]:
            return cached[0]
        meta, spec = pod["metadata"], pod["spec"]
        expiration_s = int(source.get("expirationSeconds", 3600))
        body: dict[str, Any] = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {
            "expirationSeconds": expiration_s,
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}}}
        if source.get("audience"):
            body["spec"]["audiences"] = [source["audience"]]
        account = spec.get("serviceAccountName") or "default"
        try:
            answer = self.rest.request(
                "POST", f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{account}/token", body)
        except ApiError as e:
            if e.status == 404:
                raise PodSpecError(f"serviceaccount {account!r} not found (token request)") from None
            raise
        token = answer["status"]["token"]
        run.tokens[key] = (token, time.monotonic() + TOKEN_RENEW_FRACTION * expiration_s)
        return token

    def _mounts(self, run: PodRun, pod: dict[str, Any], container: Mapping[str, Any]) -> dict[str, Path]:
        vols = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        mounts: dict[str, Path] = {}
        for m in container.get("volumeMounts", []):
            vol = vols.get(m["name"])
            if vol is None:
                raise PodSpecError(f"volumeMount {m['name']!r} names no volume")
            base = Path(vol["hostPath"]["path"]) if "hostPath" in vol else self._volume_dir(run, m["name"])
            mounts[m["mountPath"]] = base / m["subPath"] if m.get("subPath") else base
        return mounts

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
            self._spawn(cp)
        run.phase = "Running"

    def _prepare(self, run: PodRun, pod: dict[str, Any], c: Mapping[str, Any],
                 lookup: ObjectLookup) -> ContainerProcess:
        mounts = self._mounts(run, pod, c)
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

    def _spawn(self, cp: ContainerProcess) -> None:
        with open(cp.log, "ab") as out:
            cp.proc = subprocess.Popen(cp.argv, env=cp.env, cwd=cp.cwd, stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        cp.started_at, cp.exit_code, cp.ready, cp.probe_failures = now_rfc3339(), None, False, 0

    def _supervise(self, run: PodRun, pod: dict[str, Any]) -> None:
        """Probes live containers; handles exits per restartPolicy."""
        specs = {c["name"]: c for c in pod["spec"]["containers"]}
        policy = pod["spec"].get("restartPolicy", "Always")
        for cp in run.containers.values():
            if cp.alive():
                self._probe(run, cp, specs[cp.name])
                continue
            if cp.exit_code is None and cp.proc is not None:
                code = cp.proc.returncode
                # As a container runtime reports it: death by signal N is 128+N.
                cp.exit_code = code if code >= 0 else 128 - code
                cp.finished_at, cp.ready = now_rfc3339(), False
                cp.restart_after = time.monotonic() + RESTART_BACKOFF_S
            if policy == "Always" or (policy == "OnFailure" and cp.exit_code != 0):
                if time.monotonic() >= cp.restart_after:
                    cp.restart_count += 1
                    self._spawn(cp)
        if policy != "Always" and all(not cp.alive() for cp in run.containers.values()):
            codes = [cp.exit_code for cp in run.containers.values()]
            if policy == "Never" or all(code == 0 for code in codes):
                run.phase = "Succeeded" if all(code == 0 for code in codes) else "Failed"
                run.message = f"container exit codes {codes}"

    def _probe(self, run: PodRun, cp: ContainerProcess, spec: Mapping[str, Any]) -> None:
        probe = spec.get("readinessProbe")
        if not probe:
            cp.ready = True
            return
        now = time.monotonic()
        if now < cp.next_probe:
            return
        cp.next_probe = now + min(probe.get("periodSeconds", 10), MAX_PROBE_PERIOD_S)
        ok = self._probe_once(run, probe, spec)
        if ok:
            cp.ready, cp.probe_failures = True, 0
        else:
            cp.probe_failures += 1
            if not cp.ready or cp.probe_failures >= probe.get("failureThreshold", 3):
                cp.ready = False

    @staticmethod
    def _probe_port(port: int | str, spec: Mapping[str, Any]) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for p in spec.get("ports", []):
            if p.get("name") == port:
                return int(p["containerPort"])
        raise PodSpecError(f"probe names port {port!r}, which container {spec['name']!r} does not declare")

    def _probe_once(self, run: PodRun, probe: Mapping[str, Any], spec: Mapping[str, Any]) -> bool:
        timeout = min(probe.get("timeoutSeconds", 1), 1)
        if "httpGet" in probe:
            get = probe["httpGet"]
            conn = http.client.HTTPConnection(get.get("host") or run.ip, self._probe_port(get["port"], spec), timeout=timeout)
            try:
                conn.request("GET", get.get("path", "/"))
                return 200 <= conn.getresponse().status < 400
            except (OSError, http.client.HTTPException):
                return False
            finally:
                conn.close()
        if "tcpSocket" in probe:
            port = self._probe_port(probe["tcpSocket"]["port"], spec)
            try:
                with socket.create_connection((run.ip, port), timeout=timeout):
                    return True
            except OSError:
                return False
        return True  # exec/grpc probes: nothing to run them in; treat as passing

    def _status(self, run: PodRun, pod: dict[str, Any]) -> dict[str, Any]:
        statuses = []
        for c in pod["spec"]["containers"]:
            cp = run.containers.get(c["name"])
            if cp is None:  # not runnable here: shown as running and ready
                statuses.append({"name": c["name"], "image": c.get("image", ""), "imageID": "",
                                 "ready": True, "started": True, "restartCount": 0,
                                 "state": {"running": {"startedAt": run.start_time}}})
                continue
            if cp.alive():
                state = {"running": {"startedAt": cp.started_at}}
            else:
                state = {"terminated": {"exitCode": cp.exit_code if cp.exit_code is not None else -1,
                                        "reason": "Completed" if cp.exit_code == 0 else "Error",
                                        "startedAt": cp.started_at, "finishedAt": cp.finished_at}}
            statuses.append({"name": c["name"], "image": c.get("image", ""), "imageID": "",
                             "ready": cp.ready and cp.alive(), "started": cp.alive(),
                             "restartCount": cp.restart_count, "state": state})
        ready = run.phase == "Running" and all(s["ready"] for s in statuses)
        ready_str = "True" if ready else "False"
        return {
            "phase": run.phase, "message": run.message, "podIP": run.ip, "podIPs": [{"ip": run.ip}],
            "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}], "startTime": run.start_time,
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Initialized", "status": "True"},
                {"type": "ContainersReady", "status": ready_str},
                {"type": "Ready", "status": ready_str},
            ],
            "containerStatuses": statuses,
        }

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
        self.rest.request("PATCH", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                          {"metadata": {"uid": meta["uid"]}, "status": stamped}, "application/merge-patch+json")
        if run is not None:
            run.last_status = status

    def _begin_stop(self, run: PodRun, grace_s: float) -> None:
        """SIGTERM the pod's processes, once; SIGKILL is due at `run.kill_at`."""
        if run.kill_at is not None:
            return
        run.kill_at = time.monotonic() + min(max(float(grace_s), 0.0), MAX_GRACE_S)
        for cp in run.containers.values():
            if cp.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(cp.proc.pid, signal.SIGTERM)

    def _stop_run(self, run: PodRun, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """Waits for the processes until `run.kill_at` (set here if no SIGTERM was sent
        yet), SIGKILLs what is left, removes the pod's directory."""
        self._begin_stop(run, grace_s)
        deadline = run.kill_at
        for cp in run.containers.values():
            if cp.proc is None:
                continue
            try:
                cp.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(cp.proc.pid, signal.SIGKILL)
                cp.proc.wait(timeout=10)
            # Children the container left in its session die with it, as in a pod.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(cp.proc.pid, signal.SIGKILL)
        shutil.rmtree(run.dir, ignore_errors=True)
