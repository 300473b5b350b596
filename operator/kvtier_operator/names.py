"""Every name the operator puts on cluster objects: one place, one prefix (`kvtier.names.PREFIX`)."""
from __future__ import annotations

import re

# The names pods and their processes read too live in the core (the sidecar and the
# connector cannot import the operator); re-exported here with the operator's own.
from kvtier.names import (  # noqa: F401
    CONTROL_AUTH_AUDIENCE_ENV,
    CONTROL_AUTH_CA_FILE_ENV,
    CONTROL_TLS_CERT_FILE_ENV,
    CONTROL_TLS_KEY_FILE_ENV,
    CONTROL_TLS_PLAIN_HTTP_ENV,
    CONTROL_AUTH_METRICS_USERS_ENV,
    CONTROL_AUTH_MODE_ENV,
    CONTROL_AUTH_PROTECT_METRICS_ENV,
    CONTROL_AUTH_TOKEN_FILE_ENV,
    CONTROL_AUTH_USERS_ENV,
    FINALIZER,
    INJECTED_ANNOTATION,
    INJECTED_LABEL,
    INJECTION_SKIPPED_ANNOTATION,
    KV_TRANSFER_CONFIG_ENV,
    KV_TRANSFER_PARAMS_FIELD,
    OPT_OUT_LABEL,
    PEER_SECRET_FILE_ENV,
    PENDING_EPOCH_ANNOTATION,
    POD_IP_ENV,
    POD_IP_FIELD,
    POD_NAME_ENV,
    POD_NAME_FIELD,
    POD_NAMESPACE_ENV,
    POD_NAMESPACE_FIELD,
    POLICY_LABEL,
    PREFIX,
    REDIS_URL_ENV,
    ROLLOUT_REQUEST_ANNOTATION,
    RUNTIME_DIR_ENV,
    WARM_GATE,
    WEIGHT_ANNOTATION,
    WEIGHTS_VERSION_ANNOTATION,
    WEIGHTS_VERSION_ENV,
    WEIGHTS_VERSION_LABEL,
    field_env,
    warmup_kv_transfer_params,
    weights_version_env,
)

MAX_LABEL_VALUE = 63
COMPONENT_LABEL = "app.kubernetes.io/component"

# On the policy: the control certificate last issued for it (control_ca.Issued.record),
# what its renewal is decided from (the operator never reads that Secret back).
CONTROL_CERT_ANNOTATION = f"{PREFIX}/control-cert"

SIDECAR_CONTAINER = "kvtier-sidecar"
CONFIG_VOLUME = "kvtier-config"
SHM_VOLUME = "kvtier-shm"
RUN_VOLUME = "kvtier-run"
NVME_VOLUME = "kvtier-nvme"
PEER_SECRET_VOLUME = "kvtier-peer-secret"
PEER_SECRET_MOUNT_PATH = "/var/run/secrets/kvtier-peer"
PEER_SECRET_KEY = "secret"
CONTROL_TLS_VOLUME = "kvtier-control-tls"
CONTROL_TLS_MOUNT_PATH = "/var/run/secrets/kvtier-control-tls"
CONFIG_MOUNT_PATH = "/etc/kvtier"
CONFIG_KEY = "sidecar.yaml"
SHM_MOUNT_PATH = "/dev/shm"
RUN_MOUNT_PATH = "/var/run/kvtier"
AFFINITY_KEY = "table.json"
ADDRESSES_KEY = "addresses.json"
# Redis keys routers read (a hint like everything in Redis: the ConfigMap is the record).
REDIS_AFFINITY_KEY = "kvt:affinity:{namespace}:{name}"
REDIS_AFFINITY_CHANNEL = "kvt:affinity"


def injected_label_value(policy_name: str) -> str:
    """The policy's name, or for a name past a label value's 63 characters its head and
    a digest of the whole (unique per policy, still a valid label value)."""
    if len(policy_name) <= MAX_LABEL_VALUE:
        return policy_name
    import hashlib

    digest = hashlib.sha256(policy_name.encode()).hexdigest()[:16]
    return f"{policy_name[:MAX_LABEL_VALUE - 17].rstrip('.-')}-{digest}"


_LABEL_VALUE = re.compile(r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
WEIGHTS_VERSION_DIGEST_PREFIX = "h-"


def weights_version_label_value(version: str) -> str:
    """The pod's weights version as a label value: the version itself when it is one
    (at most 63 characters, alphanumerics and `-_.` inside), else `h-` and the first
    16 hex digits of its sha256. Routers only compare the labels of pods, so a digest
    keeps versions apart as well as the value; it is stable across webhook replicas
    and restarts, so every pod of one version carries the same label."""
    if len(version) <= MAX_LABEL_VALUE and _LABEL_VALUE.fullmatch(version):
        return version
    import hashlib

    return WEIGHTS_VERSION_DIGEST_PREFIX + hashlib.sha256(version.encode()).hexdigest()[:16]


def sidecar_config_map(policy_name: str) -> str:
    return f"{policy_name}-kvtier-sidecar"


def peer_secret(policy_name: str) -> str:
    """The Secret holding the policy's peer secret (created by the operator if absent)."""
    return f"{policy_name}-kvtier-peer"


def control_tls_secret(policy_name: str) -> str:
    """The Secret (kubernetes.io/tls, plus ca.crt) with the policy's control API
    certificate, issued and renewed by the operator's CA."""
    return f"{policy_name}-kvtier-control-tls"


def affinity_config_map(policy_name: str) -> str:
    return f"{policy_name}-kvtier-affinity"
