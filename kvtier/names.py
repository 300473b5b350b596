"""Every name that crosses into a pod: the `kvtier.io/` annotations and labels, and the
environment the webhook injects and the sidecar and the connector read. One place, so
the operator that writes a name and the process that reads it cannot disagree; the
operator's `kvtier_operator.names` re-exports these next to its own object names.
`tests/test_contracts.py` keeps `kvtier.io/` names and these env names out of every
other module."""
from __future__ import annotations

from typing import Any

from .peer_address import parse_peer

GROUP = "kvtier.io"
"""The API group; also the prefix of every annotation, label and finalizer of ours."""
PREFIX = GROUP
FINALIZER = f"{PREFIX}/finalizer"

# On pods the webhook injected into: which policy did it, so a second pass is a no-op.
INJECTED_ANNOTATION = f"{PREFIX}/injected-by"
# Its label twin (the webhook sets it, and removes it from pods it does not inject):
# what the policy's NetworkPolicy admits to the peer port, since anyone who may label
# a pod can give it the policy's selector labels. A label value holds 63 characters.
INJECTED_LABEL = INJECTED_ANNOTATION
# On pods a selecting policy could not inject into because its sidecar config is
# invalid: "<policy>: <what to fix>". The pod is admitted without the sidecar (never
# denied for its policy's mistake) and the policy's status names it.
INJECTION_SKIPPED_ANNOTATION = f"{PREFIX}/injection-skipped"
# Downward API source of the pod's weights version (set by the rollout on the template).
WEIGHTS_VERSION_ANNOTATION = f"{PREFIX}/weights-version"
# The same version as a pod label, set by the injection webhook from the annotation:
# routers see labels, not annotations (the EPP's version screener reads it). The value
# is the annotation's when that is a valid label value, else a digest of it.
WEIGHTS_VERSION_LABEL = WEIGHTS_VERSION_ANNOTATION
# Pods opt out of injection with this label set to "true".
OPT_OUT_LABEL = f"{PREFIX}/inject"
# A pod's home weight in the affinity table (default 1: replicas are equal).
WEIGHT_ANNOTATION = f"{PREFIX}/weight"
# Owner-policy label on the ConfigMaps the operator renders.
POLICY_LABEL = f"{PREFIX}/policy"
# Warm-up journal on the policy: the epoch being prepared and which warm-ups are done,
# so a restarted operator neither repeats them nor skips them.
PENDING_EPOCH_ANNOTATION = f"{PREFIX}/pending-epoch"
# A person's rollout control on the policy: "<promote|abort|retry|pause|resume>/<id>"
# (kubectl kvtier rollout ...); acted on once, remembered in status.rollout.handledRequest.
ROLLOUT_REQUEST_ANNOTATION = f"{PREFIX}/rollout-request"
# Warm-before-ready: the readiness gate (pod condition type) the webhook adds to a
# policy's pods when spec.rollout.warmup is set; the operator sets it True once the pod
# is warmed (or its warm-up failed or ran out of time, or it was not rolled out).
WARM_GATE = f"{PREFIX}/warm"

# --- the pod's environment -------------------------------------------------------------
# The downward API's pod identity: the sidecar names its arena and engine socket after
# it, and an engine in the same pod derives the same socket path from it.
POD_NAME_ENV = "POD_NAME"
POD_NAMESPACE_ENV = "POD_NAMESPACE"
POD_IP_ENV = "POD_IP"
# Where the sidecar's engine socket lives (the pod's shared run volume).
RUNTIME_DIR_ENV = "XDG_RUNTIME_DIR"
# The exact weights digest, from the pod's WEIGHTS_VERSION_ANNOTATION.
WEIGHTS_VERSION_ENV = "KVTIER_WEIGHTS_VERSION"
# An engine socket path that overrides the one derived from the pod identity.
ENGINE_SOCKET_ENV = "KVTIER_ENGINE_SOCKET"
# The engine's connector config, rendered from the policy.
KV_TRANSFER_CONFIG_ENV = "KVTIER_KV_TRANSFER_CONFIG"
REDIS_URL_ENV = "KVTIER_REDIS_URL"
PEER_SECRET_FILE_ENV = "KVTIER_PEER_SECRET_FILE"
CONTROL_AUTH_MODE_ENV = "KVTIER_CONTROL_AUTH_MODE"
CONTROL_AUTH_USERS_ENV = "KVTIER_CONTROL_AUTH_USERS"
CONTROL_AUTH_AUDIENCE_ENV = "KVTIER_CONTROL_AUTH_AUDIENCE"
CONTROL_AUTH_PROTECT_METRICS_ENV = "KVTIER_CONTROL_AUTH_PROTECT_METRICS"
CONTROL_AUTH_METRICS_USERS_ENV = "KVTIER_CONTROL_AUTH_METRICS_USERS"
CONTROL_AUTH_TOKEN_FILE_ENV = "KVTIER_CONTROL_AUTH_TOKEN_FILE"
CONTROL_AUTH_CA_FILE_ENV = "KVTIER_CONTROL_AUTH_CA_FILE"
CONTROL_TLS_CERT_FILE_ENV = "KVTIER_CONTROL_TLS_CERT_FILE"
CONTROL_TLS_KEY_FILE_ENV = "KVTIER_CONTROL_TLS_KEY_FILE"
CONTROL_TLS_PLAIN_HTTP_ENV = "KVTIER_CONTROL_TLS_PLAIN_HTTP"

POD_ENV = frozenset({
    POD_NAME_ENV, POD_NAMESPACE_ENV, POD_IP_ENV, WEIGHTS_VERSION_ENV, ENGINE_SOCKET_ENV, KV_TRANSFER_CONFIG_ENV,
    REDIS_URL_ENV, PEER_SECRET_FILE_ENV, CONTROL_AUTH_MODE_ENV, CONTROL_AUTH_USERS_ENV, CONTROL_AUTH_AUDIENCE_ENV,
    CONTROL_AUTH_PROTECT_METRICS_ENV, CONTROL_AUTH_METRICS_USERS_ENV, CONTROL_AUTH_TOKEN_FILE_ENV,
    CONTROL_AUTH_CA_FILE_ENV, CONTROL_TLS_CERT_FILE_ENV, CONTROL_TLS_KEY_FILE_ENV, CONTROL_TLS_PLAIN_HTTP_ENV,
})
"""Every kvtier env name of the pod contract (RUNTIME_DIR_ENV is the platform's)."""

# Downward API sources of the env above.
POD_NAME_FIELD = "metadata.name"
POD_NAMESPACE_FIELD = "metadata.namespace"
POD_IP_FIELD = "status.podIP"
WEIGHTS_VERSION_FIELD = f"metadata.annotations['{WEIGHTS_VERSION_ANNOTATION}']"


def field_env(name: str, field_path: str) -> dict[str, Any]:
    """A container env entry read from the pod's own fields (downward API)."""
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


def weights_version_env() -> dict[str, Any]:
    """WEIGHTS_VERSION_ENV from the pod's weights annotation: the rollout sets the
    annotation on the template, every container of the pod reads the same digest."""
    return field_env(WEIGHTS_VERSION_ENV, WEIGHTS_VERSION_FIELD)


# --- a request's purpose ---------------------------------------------------------------
# The rollout's warm-before-ready replays hot prefixes through a new pod's engine; those
# requests are marked so that their lookups (misses, by design: the pod is cold) are
# counted apart from traffic and never in the hit rate the alarms, the recovery check
# and the first-minute figure read. The marker rides in the completion request's body
# as `kv_transfer_params` (vLLM hands it to the KV connector as
# `request.kv_transfer_params`; the reference engine's HTTP front reads the same), and
# on the engine socket as the LOOKUP's `purpose` field. No marker: traffic.
KV_TRANSFER_PARAMS_FIELD = "kv_transfer_params"
KV_TRANSFER_PARAMS_KEY = "kvtier"  # our entry in kv_transfer_params (other connectors own theirs)
PURPOSE_FIELD = "purpose"
WARMUP_PURPOSE = "warmup"


def warmup_kv_transfer_params() -> dict[str, Any]:
    """The `kv_transfer_params` of a warm-up request: {"kvtier": {"purpose": "warmup"}}."""
    return {KV_TRANSFER_PARAMS_KEY: {PURPOSE_FIELD: WARMUP_PURPOSE}}


def is_warmup(kv_transfer_params: Any) -> bool:
    """Whether a request's `kv_transfer_params` (any JSON value, or None) marks it as a
    warm-up; anything else, malformed included, is traffic."""
    if not isinstance(kv_transfer_params, dict):
        return False
    ours = kv_transfer_params.get(KV_TRANSFER_PARAMS_KEY)
    return isinstance(ours, dict) and ours.get(PURPOSE_FIELD) == WARMUP_PURPOSE


# --- the peer-pull hint ----------------------------------------------------------------
# A router that knows which pod holds a request's prefix KV (llm-d's sets the header
# `x-kv-cache-source-host-port`) names it to the serving pod; vLLM hands a KV connector
# the body's kv_transfer_params, never the headers, so kvtier's Endpoint Picker plugin
# (router/epp/plugins/saltplugin.go) copies the header to
# kv_transfer_params.kvtier.sourcePeer, the connector passes it with its LOOKUP
# (`engine_proto.SOURCE_PEER_FIELD`), and the sidecar tries that peer first when it is a
# member of its own fleet. A hint only orders the peers asked: what a peer sends is
# verified as any peer's.
SOURCE_PEER_FIELD = "sourcePeer"


def source_peer(kv_transfer_params: Any) -> str | None:
    """The peer-pull hint of a request's `kv_transfer_params` (any JSON value, or None),
    as `host:port` in `peer_address` form; None when there is none. A sourcePeer that
    is there but is not a string host:port (null, a number, no port, port 0, a bad
    host) raises ValueError: the caller ignores it and counts it."""
    if not isinstance(kv_transfer_params, dict):
        return None
    ours = kv_transfer_params.get(KV_TRANSFER_PARAMS_KEY)
    if not isinstance(ours, dict) or SOURCE_PEER_FIELD not in ours:
        return None
    value = ours[SOURCE_PEER_FIELD]
    if isinstance(value, str) and (not value.isascii() or "%" in value):
        # parse_peer reads other scripts' digits as a port and takes an IPv6 zone (an
        # interface of the router's own host); the router's plugin refuses both.
        raise ValueError(f"peer address {value[:100]!r} must be an ASCII host:port without a zone")
    return str(parse_peer(value))
