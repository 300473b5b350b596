"""What the mutating webhook adds to a pod a policy selects. Pure and idempotent:
`inject(pod, ...)` returns the merge patch to apply, or None when there is nothing to
do (not selected, opted out, or already injected).

Added to the pod:

    containers  + kvtier-sidecar   (`kvtier-sidecar --config /etc/kvtier/sidecar.yaml`,
                                    downward-API env, HTTP/peer ports, /readyz probe);
                                    on Kubernetes >= 1.29 (`SidecarImage.native`) it is a
                                    native sidecar instead: the last of initContainers,
                                    restartPolicy Always, a /healthz startupProbe, so
                                    kubelet starts it before the engine and stops it after
    volumes     + kvtier-config    (the policy's sidecar ConfigMap)
                + kvtier-shm       (memory-backed emptyDir: the DRAM arena, mapped by the
                                    engine, so a local hit is a copy with no socket; sized
                                    arena + headroom + the engine's own /dev/shm use)
                + kvtier-run       (emptyDir: the engine socket)
                + kvtier-nvme      (hostPath spec.tiers.nvme.path, unless nvme mode is off)
                + kvtier-peer-secret (the policy's Secret <policy>-kvtier-peer, when the peer
                                    tier is on: the key peers prove themselves with)
                + kvtier-control-tls (the policy's Secret <policy>-kvtier-control-tls: the
                                    control API's certificate from the operator's CA; the
                                    HTTP port serves HTTPS only, its probe says so)
    every existing container mounts kvtier-shm at /dev/shm and kvtier-run at
    /var/run/kvtier, unless it already mounts something there, and gets the engine
    env (`engine_env`: the policy-rendered --kv-transfer-config, the weights digest,
    what locates the sidecar's socket) where it does not set it itself
    kvtier-sidecar resources: memory request = limit = arena + headroom (`arena_memory`)
    terminationGracePeriodSeconds raised (never lowered) to cover the sidecar's drain:
                                    after SIGTERM it serves peers while the operator warms
                                    its tenants on their new homes
    readinessGates + kvtier.io/warm   (only with spec.rollout.warmup and a workloadRef: the
                                    operator releases it once a pod a rollout moved is
                                    warmed, at once for any other pod; `rollout_warmup`)
    metadata.annotations[kvtier.io/injected-by] = <policy name>
    metadata.labels[kvtier.io/injected-by]      = the same (a label value: `names.injected_label_value`);
                                    removed from every pod the webhook does not inject
    metadata.labels[kvtier.io/weights-version]  = the pod's kvtier.io/weights-version annotation as a
                                    label value (`names.weights_version_label_value`: itself,
                                    or `h-` + a digest): routers screen by version on labels
                                    (the EPP sees no annotations); removed from a pod without
                                    that annotation, so no label claims a version nobody set

A policy whose sidecar config cannot be rendered (`sidecar_render.BrokenPolicy`) injects
nothing: the pod is admitted as it is, with `kvtier.io/injection-skipped` saying which
policy and what to fix, and that policy's status counts it.

The sidecar itself needs no privilege: it satisfies the `restricted` Pod Security
Standard (non-root, no privilege escalation, every capability dropped, the runtime's
default seccomp profile, a read-only root filesystem whose writable paths are the
volumes above; TMPDIR points at kvtier-run). It runs as the pod's user when the pod names one, else as the image's
non-root user; the engine must run as the same user (the arena and the engine socket
are private to it). `kvtier-nvme` is a hostPath volume, which `restricted` (and
`baseline`) namespaces refuse: keep nvme off there.
"""
from __future__ import annotations

import copy
from dataclasses import InitVar, dataclass, field
from typing import Any

from kvtier import control_api as api
from kvtier import policy
from kvtier.sidecar_config import DEFAULT_DRAIN_TIMEOUT_S, SERVICE_ACCOUNT_DIR, SidecarConfig

from kvtier_operator import arena_memory, conflicts, names
from kvtier_operator.engine_env import with_engine_env
from kvtier_operator.options import OperatorOptions

# Memory-backed volume headroom over the arena: the allocator's and Python's own pages.
SHM_HEADROOM_BYTES = 64 << 20
# The volume is every container's /dev/shm, so it also holds what the engine puts there
# itself: vLLM's shared-memory broadcast ring (160 MiB for one worker; it refuses to start
# with less free), NCCL's intra-node buffers under tensor parallelism, torch's shared
# tensors. vLLM's Kubernetes guides give /dev/shm a few GiB. A sizeLimit reserves nothing:
# only pages written count against the pod's memory.
ENGINE_SHM_BYTES = 4 << 30
# Kubernetes' terminationGracePeriodSeconds when a pod names none.
KUBERNETES_DEFAULT_GRACE_S = 30
# After its drain the sidecar flushes and deregisters from the global index and unlinks
# its arena: a few seconds, given margin so SIGKILL never cuts the deregistration short.
SIDECAR_SHUTDOWN_HEADROOM_S = 10


@dataclass(frozen=True, slots=True)
class SidecarImage:
    """How to run the sidecar: the operator's settings (`options`: the image, who may
    call the control API, TLS), not the policy's business. `image` and `tls`, when
    given, replace the options' `sidecar_image` and `sidecar_tls`."""

    options: OperatorOptions = field(default_factory=OperatorOptions)
    # A native sidecar (an init container with restartPolicy Always): what the API
    # server's version allows (`supports_native_sidecars`).
    native: bool = False
    command: tuple[str, ...] = ("kvtier-sidecar",)
    resources: dict[str, Any] = field(default_factory=dict)
    image: InitVar[str | None] = None
    tls: InitVar[bool | None] = None

    def __post_init__(self, image: str | None, tls: bool | None) -> None:
        given = {k: v for k, v in (("sidecar_image", image), ("sidecar_tls", tls)) if v is not None}
        if given:
            object.__setattr__(self, "options", self.options.model_copy(update=given))


# Sidecar containers (restartable init containers) are on by default from 1.29.
NATIVE_SIDECARS_SINCE = (1, 29)
# A native sidecar's start gates the engine's: /healthz (the process serves) within
# this, else kubelet restarts it; /readyz (which needs Redis and peers) never gates it.
SIDECAR_STARTUP_PROBE = {"periodSeconds": 1, "failureThreshold": 120}


def supports_native_sidecars(major: str, minor: str) -> bool:
    """From the API server's /version (`minor` may carry a suffix: "29+")."""
    digits = "".join(c for c in minor if c.isdigit())
    try:
        return (int(major), int(digits)) >= NATIVE_SIDECARS_SINCE
    except ValueError:
        return False


def selecting_policy(pod: dict[str, Any], policies: list[conflicts.PolicyRef]) -> str | None:
    """The policy (by name) that owns the pod: on overlap the oldest selecting policy
    (see `conflicts`), so a scale-up gets the same config as its siblings."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    if labels.get(names.OPT_OUT_LABEL) == "false":
        return None
    return conflicts.owner(labels, (meta.get("annotations") or {}).get(names.INJECTED_ANNOTATION), policies)


# An annotation value stays short: the policy's status has the whole message.
MAX_SKIPPED_NOTE_CHARS = 1024


def skipped_note(policy_name: str, problem: Exception) -> str:
    """The `injection-skipped` annotation: which policy, and what to fix in it."""
    return f"{policy_name}: {problem}"[:MAX_SKIPPED_NOTE_CHARS]


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
    init_containers = pod_spec.get("initContainers") or []
    if (meta.get("annotations") or {}).get(names.INJECTED_ANNOTATION) or any(
        c.get("name") == names.SIDECAR_CONTAINER for c in (*containers, *init_containers)
    ):
        return None
    sidecar_cfg = SidecarConfig()  # ports only; the real config is in the ConfigMap
    sidecar = _sidecar_container(policy_name, spec, image, sidecar_cfg)
    new_containers = [with_engine_env(_with_shared_mounts(c), spec) for c in containers]
    volumes = list(pod_spec.get("volumes") or [])
    taken = {v.get("name") for v in volumes}
    volumes += [v for v in _volumes(policy_name, spec, image) if v["name"] not in taken]
    patch_spec: dict[str, Any] = {"containers": new_containers, "volumes": volumes}
    if image.native:
        sidecar["restartPolicy"] = "Always"
        sidecar["startupProbe"] = {"httpGet": {"path": api.HEALTHZ.path, "port": sidecar_cfg.http_port,
                                               "scheme": "HTTPS" if image.options.sidecar_tls else "HTTP"},
                                   **SIDECAR_STARTUP_PROBE}
        patch_spec["initContainers"] = [*init_containers, sidecar]
    else:
        new_containers.append(sidecar)
    gates = list(pod_spec.get("readinessGates") or [])
    if warm_gated(spec) and not any(g.get("conditionType") == names.WARM_GATE for g in gates):
        patch_spec["readinessGates"] = [*gates, {"conditionType": names.WARM_GATE}]
    grace = pod_spec.get("terminationGracePeriodSeconds")
    needed = sidecar_grace_s()
    if (KUBERNETES_DEFAULT_GRACE_S if grace is None else grace) < needed:
        patch_spec["terminationGracePeriodSeconds"] = needed
    return {
        "metadata": {"annotations": {names.INJECTED_ANNOTATION: policy_name},
                     "labels": {names.INJECTED_LABEL: names.injected_label_value(policy_name),
                                **weights_version_label(meta)}},
        "spec": patch_spec,
    }


def weights_version_label(meta: dict[str, Any]) -> dict[str, str | None]:
    """The version label's patch for a pod's metadata: the annotation's version as a
    label value, or (no annotation, or an empty one) the removal of a label the pod
    brought itself, which would route it as a version it may not serve; {} when there
    is nothing to set or remove."""
    version = (meta.get("annotations") or {}).get(names.WEIGHTS_VERSION_ANNOTATION)
    if version:
        return {names.WEIGHTS_VERSION_LABEL: names.weights_version_label_value(str(version))}
    if names.WEIGHTS_VERSION_LABEL in (meta.get("labels") or {}):
        return {names.WEIGHTS_VERSION_LABEL: None}
    return {}


def warm_gated(spec: policy.KVCachePolicySpec) -> bool:
    """Pods of this policy carry the warm-before-ready readiness gate: a warm-up is
    configured (`spec.rollout.warmup`, a budget above 0) and there is a rollout to
    drive it (`workloadRef`). Otherwise pods are admitted exactly as before."""
    return spec.rollout.warms and spec.workload_ref is not None


def unforged(pod: dict[str, Any]) -> dict[str, Any] | None:
    """The patch removing an injected-by label from a pod the webhook does not inject
    (only the webhook may say a pod runs a policy's sidecar), or None."""
    if names.INJECTED_LABEL in ((pod.get("metadata") or {}).get("labels") or {}):
        return {"labels": {names.INJECTED_LABEL: None}}
    return None


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


def _volumes(policy_name: str, spec: policy.KVCachePolicySpec, image: SidecarImage) -> list[dict[str, Any]]:
    arena_bytes = policy.parse_quantity_bytes(spec.tiers.dram.capacity)
    tls = [{"name": names.CONTROL_TLS_VOLUME, "secret": {"secretName": names.control_tls_secret(policy_name)}}]
    return tls * image.options.sidecar_tls + [
        {"name": names.CONFIG_VOLUME, "configMap": {"name": names.sidecar_config_map(policy_name)}},
        {"name": names.SHM_VOLUME, "emptyDir": {"medium": "Memory",
                                                "sizeLimit": str(arena_bytes + SHM_HEADROOM_BYTES + ENGINE_SHM_BYTES)}},
        {"name": names.RUN_VOLUME, "emptyDir": {}},
    ] + ([{"name": names.PEER_SECRET_VOLUME, "secret": {"secretName": names.peer_secret(policy_name)}}]
         if spec.tiers.peer.enabled else []) + ([{"name": names.NVME_VOLUME, "hostPath": {"path": spec.tiers.nvme.path, "type": "DirectoryOrCreate"}}]
         if spec.tiers.nvme.mode != "off" else [])


def restricted_security_context() -> dict[str, Any]:
    """The sidecar container's securityContext: what the `restricted` Pod Security
    Standard asks of a container, and a read-only root filesystem."""
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _env(spec: policy.KVCachePolicySpec) -> list[dict[str, Any]]:
    env = [
        names.field_env(names.POD_NAME_ENV, names.POD_NAME_FIELD),
        names.field_env(names.POD_NAMESPACE_ENV, names.POD_NAMESPACE_FIELD),
        names.field_env(names.POD_IP_ENV, names.POD_IP_FIELD),
        names.weights_version_env(),
        {"name": names.RUNTIME_DIR_ENV, "value": names.RUN_MOUNT_PATH},
        # The root filesystem is read-only: temporary files go to the writable volume.
        {"name": "TMPDIR", "value": names.RUN_MOUNT_PATH},
    ]
    if spec.redis and spec.redis.secret_ref:
        ref = spec.redis.secret_ref
        env.append({"name": names.REDIS_URL_ENV, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    return env


def _auth_env(image: SidecarImage) -> list[dict[str, Any]]:
    """The operator's identity travels with the pod, not the policy's ConfigMap: it is
    the operator's deployment that decides who the operator is."""
    options = image.options
    env = [{"name": names.CONTROL_AUTH_MODE_ENV, "value": options.sidecar_auth}]
    if options.sidecar_auth == "tokenreview":
        # The pod's own ServiceAccount token calls TokenReview (named here, so a runtime
        # that maps mount paths sees them too).
        env += [{"name": names.CONTROL_AUTH_USERS_ENV, "value": ",".join(options.sidecar_auth_users)},
                {"name": names.CONTROL_AUTH_TOKEN_FILE_ENV, "value": f"{SERVICE_ACCOUNT_DIR}/token"},
                {"name": names.CONTROL_AUTH_CA_FILE_ENV, "value": f"{SERVICE_ACCOUNT_DIR}/ca.crt"},
                {"name": names.CONTROL_AUTH_PROTECT_METRICS_ENV,
                 "value": str(options.sidecar_protect_metrics).lower()}]
        if options.sidecar_metrics_users:
            env.append({"name": names.CONTROL_AUTH_METRICS_USERS_ENV, "value": ",".join(options.sidecar_metrics_users)})
        # The operator mints a token per pod: the sidecar accepts its pod's own audience only.
        # POD_NAMESPACE and POD_NAME come first in the env: $(...) expands them.
        if options.sidecar_token_service_account:
            env.append({"name": names.CONTROL_AUTH_AUDIENCE_ENV,
                        "value": api.pod_audience("$(POD_NAMESPACE)", "$(POD_NAME)")})
    return env


def _sidecar_container(
    policy_name: str, spec: policy.KVCachePolicySpec, image: SidecarImage, cfg: SidecarConfig
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": names.SIDECAR_CONTAINER,
        "image": image.options.sidecar_image,
        "imagePullPolicy": image.options.sidecar_image_pull_policy,
        "command": [*image.command, "--config", f"{names.CONFIG_MOUNT_PATH}/{names.CONFIG_KEY}"],
        "env": _env(spec) + _auth_env(image),
        "ports": [
            {"name": "kvtier-http", "containerPort": cfg.http_port, "protocol": "TCP"},
            {"name": "kvtier-peer", "containerPort": cfg.peer_port, "protocol": "TCP"},
        ],
        "readinessProbe": {"httpGet": {"path": api.READYZ.path, "port": cfg.http_port,
                                       "scheme": "HTTPS" if image.options.sidecar_tls else "HTTP"}, "periodSeconds": 5},
        "volumeMounts": [
            {"name": names.CONFIG_VOLUME, "mountPath": names.CONFIG_MOUNT_PATH, "readOnly": True},
            {"name": names.SHM_VOLUME, "mountPath": names.SHM_MOUNT_PATH},
            {"name": names.RUN_VOLUME, "mountPath": names.RUN_MOUNT_PATH},
        ],
        "securityContext": restricted_security_context(),
    }
    if spec.tiers.peer.enabled:
        container["volumeMounts"].append({"name": names.PEER_SECRET_VOLUME, "mountPath": names.PEER_SECRET_MOUNT_PATH,
                                          "readOnly": True})
        container["env"].append({"name": names.PEER_SECRET_FILE_ENV,
                                 "value": f"{names.PEER_SECRET_MOUNT_PATH}/{names.PEER_SECRET_KEY}"})
    if image.options.sidecar_tls:
        container["volumeMounts"].append({"name": names.CONTROL_TLS_VOLUME, "mountPath": names.CONTROL_TLS_MOUNT_PATH,
                                          "readOnly": True})
        container["env"] += [{"name": names.CONTROL_TLS_CERT_FILE_ENV, "value": f"{names.CONTROL_TLS_MOUNT_PATH}/tls.crt"},
                             {"name": names.CONTROL_TLS_KEY_FILE_ENV, "value": f"{names.CONTROL_TLS_MOUNT_PATH}/tls.key"}]
    else:
        container["env"].append({"name": names.CONTROL_TLS_PLAIN_HTTP_ENV, "value": "true"})
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
