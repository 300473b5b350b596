"""What a pod's processes see, as kubelet would build it: the environment (values with
$(VAR) expansion, downward API fieldRefs, configMapKeyRef/secretKeyRef, envFrom), every
mountPath rewritten to its local directory, a unique loopback pod IP and a short
per-pod directory. Pure, except for the pod-IP counter."""
from __future__ import annotations

import hashlib
import itertools
import os
import re
import threading
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier_testenv.kubeapi import ObjectLookup

# Per-pod directories are named by this many hex digits of a hash of the pod uid.
POD_DIR_HASH_CHARS = 10


def _pod_net() -> int:
    """Pod IPs come from a 127.N.0.0/16 picked by process id, away from 127.0.0.0/24
    that servers in tests use: test runs sharing a machine rarely hand out the same
    address. The workers of one parallel run (pytest-xdist sets PYTEST_XDIST_WORKER to
    gw0, gw1, ...) pick by their controller's process id and their own number, so two
    of them never share one."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
        return 1 + (os.getppid() * count + int(worker[2:])) % 254
    return 1 + os.getpid() % 254


_POD_NET = _pod_net()
_POD_IPS = (f"127.{_POD_NET}.{i // 254}.{i % 254 + 1}" for i in itertools.count(1))
_POD_IPS_LOCK = threading.Lock()
_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


def next_pod_ip() -> str:
    """A loopback address no other pod of this Python process has had."""
    with _POD_IPS_LOCK:
        return next(_POD_IPS)


class PodSpecError(ValueError):
    """The pod cannot be started as written (e.g. a required ConfigMap key is missing)."""


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


def pod_key(pod: Mapping[str, Any]) -> str:
    return f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"


def is_ready(pod: Mapping[str, Any]) -> bool:
    for cond in pod.get("status", {}).get("conditions", []):
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False
