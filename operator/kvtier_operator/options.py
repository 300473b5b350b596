"""The operator's own settings (not a policy's): flags of `kvtier-operator`, passed to
the kopf handlers through the environment so `kopf run` and tests see the same."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier_operator.netpol import SidecarAccess

ENV_PREFIX = "KVTIER_OPERATOR_"
# Watches are re-established at least this often, so a silently dropped connection
# (a load balancer's idle timeout) cannot starve the operator of events.
WATCH_SERVER_TIMEOUT_S = 120
WATCH_CLIENT_TIMEOUT_S = 150
WATCH_CONNECT_TIMEOUT_S = 10
# A membership loop re-checks even without a pod event: level-based safety net.
RESYNC_INTERVAL_S = 60.0
# Pod events arriving this close together are planned as one epoch.
DEBOUNCE_S = 0.3
# Warm-ups in flight per target sidecar: a new home keeps most of its peer link and
# CPU for live traffic while it is being warmed.
WARMS_PER_TARGET = 2
# The operator's CA Secret (and its public twin, a ConfigMap) in the operator's namespace.
DEFAULT_CONTROL_CA_SECRET = "kvtier-control-ca"
# The label the chart gives the operator's pods (charts/kvtier, kvtier.selectorLabels).
DEFAULT_OPERATOR_POD_LABELS = "app.kubernetes.io/name=kvtier-operator"


@dataclass(frozen=True, slots=True)
class OperatorOptions:
    sidecar_image: str = "ghcr.io/kvtier/kvtier:0.1.0"
    webhook_host: str | None = None  # None: no webhook server (injection off)
    webhook_port: int = 9443
    webhook_cert: str | None = None
    webhook_key: str | None = None
    resync_interval_s: float = RESYNC_INTERVAL_S
    debounce_s: float = DEBOUNCE_S
    warms_per_target: int = WARMS_PER_TARGET
    metrics_host: str = "0.0.0.0"  # the pod's metrics port: scraped from inside the cluster
    metrics_port: int = 0  # 0: no metrics server
    # The sidecars' control API: "tokenreview" (the injected sidecars accept only
    # `sidecar_auth_users`, checked with TokenReview) or "open" (loopback tests only).
    sidecar_auth: str = "tokenreview"
    sidecar_auth_users: str = ""  # comma-separated; normally this operator's own ServiceAccount
    sidecar_protect_metrics: bool = False  # /metrics needs the token too
    sidecar_metrics_users: str = ""  # comma-separated identities allowed /metrics only
    # This operator's projected token for the sidecars' shared audience (re-read as
    # kubelet rotates it) ...
    sidecar_token_file: str | None = None
    # ... or, preferred, "namespace/name" of this operator's ServiceAccount, whose tokens
    # it mints per sidecar for that pod's own audience (`control_api.pod_audience`).
    sidecar_token_service_account: str = ""
    # The sidecars' control API over TLS, certificates from this operator's CA, kept in
    # the Secret `control_ca_secret` of `operator_namespace` (made when absent). Off:
    # sidecars serve plain HTTP and get no token (a loopback lab only).
    sidecar_tls: bool = True
    control_ca_secret: str = DEFAULT_CONTROL_CA_SECRET
    # A NetworkPolicy per KVCachePolicy guarding the sidecars' ports (see netpol).
    network_policies: bool = False
    operator_namespace: str = ""
    # k=v,k=v: this operator's pods, allowed to the HTTP port (never empty: that would
    # be every pod of the operator's namespace); the chart's selector label by default.
    operator_pod_labels: str = DEFAULT_OPERATOR_POD_LABELS
    monitoring_namespace: str = ""  # allowed to the HTTP port (metrics); empty: none
    serving_ports_open: bool = True
    # "auto": a native sidecar (restartable init container) where the API server is
    # >= 1.29, else a plain container; "never": always the plain container.
    native_sidecars: str = "never"

    def sidecar_access(self) -> "SidecarAccess | None":
        """What the per-policy NetworkPolicy allows; None when they are off."""
        from kvtier_operator.netpol import SidecarAccess

        if not self.network_policies:
            return None
        labels = dict(kv.split("=", 1) for kv in self.operator_pod_labels.split(",") if "=" in kv)
        return SidecarAccess(self.operator_namespace, labels, self.monitoring_namespace or None,
                             self.serving_ports_open)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "OperatorOptions":
        env = dict(os.environ if env is None else env)
        get = lambda key, default=None: env.get(ENV_PREFIX + key, default)  # noqa: E731
        return cls(
            sidecar_image=get("SIDECAR_IMAGE", cls.sidecar_image),
            webhook_host=get("WEBHOOK_HOST"),
            webhook_port=int(get("WEBHOOK_PORT", cls.webhook_port)),
            webhook_cert=get("WEBHOOK_CERT"),
            webhook_key=get("WEBHOOK_KEY"),
            resync_interval_s=float(get("RESYNC_INTERVAL_S", cls.resync_interval_s)),
            debounce_s=float(get("DEBOUNCE_S", cls.debounce_s)),
            warms_per_target=int(get("WARMS_PER_TARGET", cls.warms_per_target)),
            sidecar_auth=get("SIDECAR_AUTH", "tokenreview"),
            sidecar_auth_users=get("SIDECAR_AUTH_USERS", ""),
            sidecar_protect_metrics=get("SIDECAR_PROTECT_METRICS", "false") == "true",
            sidecar_metrics_users=get("SIDECAR_METRICS_USERS", ""),
            sidecar_token_file=get("SIDECAR_TOKEN_FILE"),
            sidecar_token_service_account=get("SIDECAR_TOKEN_SERVICE_ACCOUNT", ""),
            sidecar_tls=get("SIDECAR_TLS", "true") == "true",
            control_ca_secret=get("CONTROL_CA_SECRET", "") or DEFAULT_CONTROL_CA_SECRET,
            network_policies=get("NETWORK_POLICIES", "false") == "true",
            operator_namespace=get("OPERATOR_NAMESPACE", ""),
            operator_pod_labels=get("OPERATOR_POD_LABELS", "") or DEFAULT_OPERATOR_POD_LABELS,
            monitoring_namespace=get("MONITORING_NAMESPACE", ""),
            serving_ports_open=get("SERVING_PORTS_OPEN", "true") == "true",
            metrics_host=get("METRICS_HOST", cls.metrics_host),
            metrics_port=int(get("METRICS_PORT", cls.metrics_port)),
            native_sidecars=get("NATIVE_SIDECARS", cls.native_sidecars),
        )

    def to_env(self) -> dict[str, str]:
        out = {
            "SIDECAR_IMAGE": self.sidecar_image,
            "WEBHOOK_PORT": str(self.webhook_port),
            "RESYNC_INTERVAL_S": str(self.resync_interval_s),
            "DEBOUNCE_S": str(self.debounce_s),
            "WARMS_PER_TARGET": str(self.warms_per_target),
            "SIDECAR_AUTH": self.sidecar_auth,
            "SIDECAR_PROTECT_METRICS": str(self.sidecar_protect_metrics).lower(),
            "SIDECAR_TLS": str(self.sidecar_tls).lower(),
            "CONTROL_CA_SECRET": self.control_ca_secret,
            "NETWORK_POLICIES": str(self.network_policies).lower(),
            "SERVING_PORTS_OPEN": str(self.serving_ports_open).lower(),
            "METRICS_HOST": self.metrics_host,
            "METRICS_PORT": str(self.metrics_port),
            "NATIVE_SIDECARS": self.native_sidecars,
        }
        for key, value in (("WEBHOOK_HOST", self.webhook_host), ("WEBHOOK_CERT", self.webhook_cert),
                           ("WEBHOOK_KEY", self.webhook_key), ("SIDECAR_AUTH_USERS", self.sidecar_auth_users),
                           ("SIDECAR_TOKEN_FILE", self.sidecar_token_file),
                           ("SIDECAR_TOKEN_SERVICE_ACCOUNT", self.sidecar_token_service_account),
                           ("SIDECAR_METRICS_USERS", self.sidecar_metrics_users),
                           ("OPERATOR_NAMESPACE", self.operator_namespace),
                           ("OPERATOR_POD_LABELS", self.operator_pod_labels),
                           ("MONITORING_NAMESPACE", self.monitoring_namespace)):
            if value:
                out[key] = value
        return {ENV_PREFIX + k: v for k, v in out.items()}
