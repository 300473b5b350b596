"""Every name the operator puts on cluster objects: one place, one prefix (`kvtier.io/`)."""
from __future__ import annotations

from kvtier import policy

PREFIX = policy.GROUP  # "kvtier.io": our finalizer, annotations and labels
FINALIZER = f"{PREFIX}/finalizer"

# On pods the webhook injected into: which policy did it, so a second pass is a no-op.
INJECTED_ANNOTATION = f"{PREFIX}/injected-by"
# Its label twin (the webhook sets it, and removes it from pods it does not inject):
# what the policy's NetworkPolicy admits to the peer port, since anyone who may label
# a pod can give it the policy's selector labels. A label value holds 63 characters.
INJECTED_LABEL = INJECTED_ANNOTATION
MAX_LABEL_VALUE = 63
# On pods a selecting policy could not inject into because its sidecar config is
# invalid: "<policy>: <what to fix>". The pod is admitted without the sidecar (never
# denied for its policy's mistake) and the policy's status names it.
INJECTION_SKIPPED_ANNOTATION = f"{PREFIX}/injection-skipped"
# Downward API source of the pod's weights version (set by the rollout on the template).
WEIGHTS_VERSION_ANNOTATION = f"{PREFIX}/weights-version"
# Pods opt out of injection with this label set to "true".
OPT_OUT_LABEL = f"{PREFIX}/inject"
# Owner-policy label on the ConfigMaps the operator renders.
POLICY_LABEL = f"{PREFIX}/policy"
COMPONENT_LABEL = "app.kubernetes.io/component"
# Warm-up journal on the policy: the epoch being prepared and which warm-ups are done,
# so a restarted operator neither repeats them nor skips them.
PENDING_EPOCH_ANNOTATION = f"{PREFIX}/pending-epoch"
# A person's rollout control on the policy: "<promote|abort|retry|pause|resume>/<id>"
# (kubectl kvtier rollout ...); acted on once, remembered in status.rollout.handledRequest.
ROLLOUT_REQUEST_ANNOTATION = f"{PREFIX}/rollout-request"

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
