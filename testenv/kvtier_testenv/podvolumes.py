"""A pod's volumes, as kubelet materialises them: ConfigMap, Secret, downwardAPI and
projected volumes (serviceAccountToken from the TokenRequest API, renewed at 80% of
its lifetime; configMap; secret; downwardAPI) in kubelet's atomic `..data` symlink
layout, kept in sync when the sources change; emptyDir as a directory; hostPath as
itself. Also what the ServiceAccount admission plugin would add to a pod."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvtier_testenv.kubeapi import ApiError, ObjectLookup, RestClient
from kvtier_testenv.podenv import PodSpecError, field_ref, pod_dir_name
from kvtier_testenv.supervisor import PodRun

# kubelet syncs volumes every ~60 s; tests want a ConfigMap edit visible in seconds.
VOLUME_SYNC_S = 1.0
# kubelet renews a projected token once 80% of its lifetime has passed.
TOKEN_RENEW_FRACTION = 0.8
# What the ServiceAccount admission plugin asks for (3607 s: one hour plus the
# plugin's marker seconds, which extend a legacy-style token's validity).
SERVICE_ACCOUNT_TOKEN_EXPIRATION_S = 3607
SERVICE_ACCOUNT_MOUNT_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
ROOT_CA_CONFIG_MAP = "kube-root-ca.crt"

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


class VolumeSyncer:
    """Keeps each pod's volume directories in line with their sources."""

    def __init__(self, rest: RestClient) -> None:
        self.rest = rest

    def volume_dir(self, run: PodRun, name: str) -> Path:
        return run.dir / "volumes" / name

    def sync(self, run: PodRun, pod: dict[str, Any], lookup: ObjectLookup) -> bool:
        if time.monotonic() < run.next_volume_sync and run.containers:
            return True
        run.next_volume_sync = time.monotonic() + VOLUME_SYNC_S
        for vol in pod["spec"].get("volumes", []):
            target = self.volume_dir(run, vol["name"])
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

    def mounts(self, run: PodRun, pod: dict[str, Any], container: Mapping[str, Any]) -> dict[str, Path]:
        vols = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        mounts: dict[str, Path] = {}
        for m in container.get("volumeMounts", []):
            vol = vols.get(m["name"])
            if vol is None:
                raise PodSpecError(f"volumeMount {m['name']!r} names no volume")
            base = Path(vol["hostPath"]["path"]) if "hostPath" in vol else self.volume_dir(run, m["name"])
            mounts[m["mountPath"]] = base / m["subPath"] if m.get("subPath") else base
        return mounts
