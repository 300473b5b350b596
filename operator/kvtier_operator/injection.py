"""What the mutating webhook adds to a pod a policy selects. Pure and idempotent:
`inject(pod, ...)` returns the merge patch to apply, or None when there is nothing to
do (not selected, opted out, or already injected).

Added to the pod:

    containers  + kvtier-sidecar   (`kvtier-sidecar --config /etc/kvtier/sidecar.yaml`,
                                    downward-API env, HTTP/peer ports, /readyz probe)
    volumes     + kvtier-config    (the policy's sidecar ConfigMap)
                + kvtier-shm       (memory-backed emptyDir: the DRAM arena, mapped by the
                                    engine, so a local hit is a copy with no socket)
                + kvtier-run       (emptyDir: the engine socket)
                + kvtier-nvme      (hostPath spec.tiers.nvme.path, unless nvme mode is off)
    every existing container mounts kvtier-shm at /dev/shm and kvtier-run at
    /var/run/kvtier, unless it already mounts something there, and gets the engine
    env (`engine_env`: the policy-rendered --kv-transfer-config, the weights digest,
    what locates the sidecar's socket) where it does not set it itself
    kvtier-sidecar resources: memory request = limit = arena + headroom (`arena_memory`)
    terminationGracePeriodSeconds raised (never lowered) to cover the sidecar's drain:
                                    after SIGTERM it serves peers while the operator warms
                                    its tenants on their new homes
    metadata.annotations[kvtier.io/injected-by] = <policy name>
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from kvtier import policy
from kvtier.sidecar_config import DEFAULT_DRAIN_TIMEOUT_S, SidecarConfig

from kvtier_operator import arena_memory, conflicts, names
from kvtier_operator.engine_env import with_engine_env

# Memory-backed volume headroom over the arena: the allocator's and Python's own pages.
SHM_HEADROOM_BYTES = 64 << 20
# Kubernetes' terminationGracePeriodSeconds when a pod names none.
KUBERNETES_DEFAULT_GRACE_S = 30
# After its drain the sidecar flushes and deregisters from the global index and unlinks
# its arena: a few seconds, given margin so SIGKILL never cuts the deregistration short.
SIDECAR_SHUTDOWN_HEADROOM_S = 10


@dataclass(frozen=True, slots=True)
class SidecarImage:
    """How to run the sidecar: the operator's flags, not the policy's business."""

    image: str = "ghcr.io/kvtier/kvtier:0.1.0"
    command: tuple[str, ...] = ("kvtier-sidecar",)
    pull_policy: str = "IfNotPresent"
    resources: dict[str, Any] = field(default_factory=dict)


def selecting_policy(pod: dict[str, Any], policies: list[conflicts.PolicyRef]) -> str | None:
    """The policy (by name) that owns the pod: on overlap the oldest selecting policy
    (see `conflicts`), so a scale-up gets the same config as its siblings."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    if labels.get(names.OPT_OUT_LABEL) == "false":
        return None
    return conflicts.owner(labels, (meta.get("annotations") or {}).get(names.INJECTED_ANNOTATION), policies)


def inject(
    pod: dict[str, Any],
    policy_name: str,
    spec: policy.KVCachePolicySpec,
    image: SidecarImage,
) -> dict[str, Any] | None:
    """The merge patch (metadata + spec lists replaced whole) that injects the sidecar."""
    meta = pod.get("metadata") or {}
    pod_spec = pod.get("spec") or {}
    containers = pod_spec.get("containers") or []
    if (meta.get("annotations") or {}).get(names.INJECTED_ANNOTATION) or any(
        c.get("name") == names.SIDECAR_CONTAINER for c in containers
    ):
        return None
    sidecar_cfg = SidecarConfig()  # ports only; the real config is in the ConfigMap
    new_containers = [with_engine_env(_with_shared_mounts(c), spec) for c in containers] + [
        _sidecar_container(policy_name, spec, image, sidecar_cfg)
    ]
    volumes = list(pod_spec.get("volumes") or [])
    taken = {v.get("name") for v in volumes}
    volumes += [v for v in _volumes(policy_name, spec) if v["name"] not in taken]
    patch_spec: dict[str, Any] = {"containers": new_containers, "volumes": volumes}
    grace = pod_spec.get("terminationGracePeriodSeconds")
    needed = sidecar_grace_s()
    if (KUBERNETES_DEFAULT_GRACE_S if grace is None else grace) < needed:
        patch_spec["terminationGracePeriodSeconds"] = needed
    return {
        "metadata": {"annotations": {names.INJECTED_ANNOTATION: policy_name}},
        "spec": patch_spec,
    }


def sidecar_grace_s(drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> int:
    """The pod grace period the sidecar needs to drain and then shut down cleanly."""
    return int(-(-drain_timeout_s // 1)) + SIDECAR_SHUTDOWN_HEADROOM_S


def _with_shared_mounts(container: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(container)
    mounts = out.setdefault("volumeMounts", [])
    paths = {m.get("mountPath") for m in mounts}
    for volume, path in ((names.SHM_VOLUME, names.SHM_MOUNT_PATH), (names.RUN_VOLUME, names.RUN_MOUNT_PATH)):
        if path not in paths:
            mounts.append({"name": volume, "mountPath": path})
    return out


def _volumes(policy_name: str, spec: policy.KVCachePolicySpec) -> list[dict[str, Any]]:
    arena_bytes = policy.parse_quantity_bytes(spec.tiers.dram.capacity)
    return [
        {"name": names.CONFIG_VOLUME, "configMap": {"name": names.sidecar_config_map(policy_name)}},
        {"name": names.SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": str(arena_bytes + SHM_HEADROOM_BYTES)}},
        {"name": names.RUN_VOLUME, "emptyDir": {}},
    ] + ([{"name": names.NVME_VOLUME, "hostPath": {"path": spec.tiers.nvme.path, "type": "DirectoryOrCreate"}}]
         if spec.tiers.nvme.mode != "off" else [])


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _env(spec: policy.KVCachePolicySpec) -> list[dict[str, Any]]:
    env = [
        _field_env("POD_NAME", "metadata.name"),
        _field_env("POD_NAMESPACE", "metadata.namespace"),
        _field_env("POD_IP", "status.podIP"),
        _field_env("KVTIER_WEIGHTS_VERSION", f"metadata.annotations['{names.WEIGHTS_VERSION_ANNOTATION}']"),
        {"name": "XDG_RUNTIME_DIR", "value": names.RUN_MOUNT_PATH},
    ]
    if spec.redis and spec.redis.secret_ref:
        ref = spec.redis.secret_ref
        env.append({"name": "KVTIER_REDIS_URL", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    return env


def _sidecar_container(
    policy_name: str, spec: policy.KVCachePolicySpec, image: SidecarImage, cfg: SidecarConfig
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": names.SIDECAR_CONTAINER,
        "image": image.image,
        "imagePullPolicy": image.pull_policy,
        "command": [*image.command, "--config", f"{names.CONFIG_MOUNT_PATH}/{names.CONFIG_KEY}"],
        "env": _env(spec),
        "ports": [
            {"name": "kvtier-http", "containerPort": cfg.http_port, "protocol": "TCP"},
            {"name": "kvtier-peer", "containerPort": cfg.peer_port, "protocol": "TCP"},
        ],
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": cfg.http_port}, "periodSeconds": 5},
        "volumeMounts": [
            {"name": names.CONFIG_VOLUME, "mountPath": names.CONFIG_MOUNT_PATH, "readOnly": True},
            {"name": names.SHM_VOLUME, "mountPath": names.SHM_MOUNT_PATH},
            {"name": names.RUN_VOLUME, "mountPath": names.RUN_MOUNT_PATH},
        ],
    }
    if spec.tiers.nvme.mode != "off":  # the shadow probe (and a future tier) uses the node's disk
        container["volumeMounts"].append({"name": names.NVME_VOLUME, "mountPath": spec.tiers.nvme.path})
    container["resources"] = _resources(spec, image)
    return container


def _resources(spec: policy.KVCachePolicySpec, image: SidecarImage) -> dict[str, Any]:
    """The operator's default resources (CPU, say), with memory sized to the arena."""
    out = copy.deepcopy(image.resources)
    for kind, values in arena_memory.sidecar_resources(spec).items():
        out.setdefault(kind, {}).update(values)
    return out
