"""`kvtier-operator`: run the KVCachePolicy operator (kopf) with kvtier's settings.

    kvtier-operator [--namespace NS ...] [--sidecar-image IMG]
                    [--webhook-host HOST --webhook-port PORT (--webhook-cert F --webhook-key F
                     | --webhook-self-signed DIR)] [--warms-per-target N] [--liveness URL]
                    [--service-account-dir DIR] [--verbose]

Without --namespace it watches all namespaces. Without --webhook-host it serves no
admission webhook (sidecar injection off). One replica only (Recreate): the operator
keeps per-policy state in the objects' status and `kvtier.io/` annotations.

--service-account-dir names where the pod's ServiceAccount credentials (token, ca.crt,
namespace) are mounted. The client library and kopf read them from the fixed path
/var/run/secrets/kubernetes.io/serviceaccount; the chart passes that path explicitly so
a runtime that mounts volumes elsewhere (the test node agent runs pods as local
processes and rewrites mount paths in args) still logs in with the pod's own token,
against $KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT as in any pod.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvtier_operator.options import OperatorOptions

# Flag defaults from an instance: on a slots dataclass the class attribute is a
# member descriptor, not the default value.
_DEFAULTS = OperatorOptions()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier-operator", description=__doc__.split("\n\n")[0])
    p.add_argument("--namespace", action="append", default=[], help="watch only this namespace (repeatable)")
    p.add_argument("--sidecar-image", default=_DEFAULTS.sidecar_image, help="image of the injected sidecar")
    p.add_argument("--native-sidecars", choices=("auto", "never"), default=_DEFAULTS.native_sidecars,
                   help="auto: inject a native sidecar (init container, restartPolicy Always) where the "
                        "API server is >= 1.29; never: a plain container")
    p.add_argument("--webhook-host", help="address the webhook listens on and the apiserver reaches it by")
    p.add_argument("--webhook-port", type=int, default=_DEFAULTS.webhook_port)
    p.add_argument("--webhook-cert", help="PEM serving certificate (e.g. mounted from a Secret)")
    p.add_argument("--webhook-key", help="PEM private key of --webhook-cert")
    p.add_argument("--webhook-self-signed", type=Path, metavar="DIR",
                   help="make a self-signed certificate in DIR (its cert.pem is the webhook's caBundle)")
    p.add_argument("--warms-per-target", type=int, default=_DEFAULTS.warms_per_target,
                   help="warm-ups in flight per new home when tenants move")
    p.add_argument("--sidecar-auth", choices=("tokenreview", "open"), default=_DEFAULTS.sidecar_auth,
                   help="the injected sidecars' control API: TokenReview-checked (default) or open")
    p.add_argument("--sidecar-auth-user", action="append", default=[],
                   help="identity the sidecars accept (repeatable), e.g. system:serviceaccount:NS:NAME")
    p.add_argument("--sidecar-protect-metrics", action="store_true",
                   help="the sidecars' /metrics needs the operator's token too")
    p.add_argument("--sidecar-metrics-user", action="append", default=[],
                   help="identity allowed the sidecars' protected /metrics only (repeatable)")
    p.add_argument("--sidecar-token-file",
                   help="this operator's projected ServiceAccount token for the sidecars' shared audience")
    p.add_argument("--sidecar-token-service-account", default="", metavar="NAMESPACE/NAME",
                   help="this operator's ServiceAccount: mint a short-lived token per sidecar for that pod's "
                        "own audience (preferred to --sidecar-token-file)")
    p.add_argument("--sidecar-plain-http", action="store_true",
                   help="sidecars serve their control API without TLS and get no token (a loopback lab only; "
                        "default: HTTPS with certificates from this operator's CA)")
    p.add_argument("--control-ca-secret", default=_DEFAULTS.control_ca_secret, metavar="NAME",
                   help="the Secret in --operator-namespace holding the control CA (made when absent)")
    p.add_argument("--network-policies", action="store_true",
                   help="write a NetworkPolicy per KVCachePolicy guarding the sidecars' ports")
    p.add_argument("--operator-namespace", default="",
                   help="this operator's namespace (its control CA Secret; the NetworkPolicy peer)")
    p.add_argument("--operator-pod-labels", default="", help="k=v,k=v labels of this operator's pods")
    p.add_argument("--monitoring-namespace", default="", help="namespace allowed to scrape sidecar metrics")
    p.add_argument("--close-serving-ports", action="store_true",
                   help="the per-policy NetworkPolicy leaves the pods' other ports to other policies")
    p.add_argument("--liveness", help="serve kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--service-account-dir", type=Path, metavar="DIR",
                   help="in-cluster credentials (token, ca.crt, namespace) mounted here")
    p.add_argument("--metrics-port", type=int, default=_DEFAULTS.metrics_port,
                   help="serve the rollout metrics on this port (0: off)")
    p.add_argument("--metrics-host", default=_DEFAULTS.metrics_host,
                   help="address the metrics server listens on (e.g. the pod IP)")
    p.add_argument("--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if (args.webhook_cert is None) != (args.webhook_key is None):
        print("kvtier-operator: --webhook-cert and --webhook-key go together", file=sys.stderr)
        return 2
    if (args.webhook_cert or args.webhook_self_signed) and not args.webhook_host:
        print("kvtier-operator: --webhook-host is required with a webhook certificate", file=sys.stderr)
        return 2
    if args.network_policies and not (args.operator_namespace and args.operator_pod_labels):
        print("kvtier-operator: --network-policies needs --operator-namespace and --operator-pod-labels",
              file=sys.stderr)
        return 2
    if not args.sidecar_plain_http and not args.operator_namespace:
        print("kvtier-operator: --operator-namespace is required: the sidecars' control CA Secret lives there "
              "(or --sidecar-plain-http, a loopback lab only)", file=sys.stderr)
        return 2
    if args.sidecar_token_service_account.count("/") != 1:
        if args.sidecar_token_service_account:
            print("kvtier-operator: --sidecar-token-service-account is NAMESPACE/NAME", file=sys.stderr)
            return 2
    if args.warms_per_target < 1:
        print("kvtier-operator: --warms-per-target must be at least 1", file=sys.stderr)
        return 2
    cert, key = args.webhook_cert, args.webhook_key
    if args.webhook_self_signed:
        from kvtier_operator import certs

        made = certs.self_signed(args.webhook_self_signed, [args.webhook_host])
        cert, key = str(made.cert), str(made.key)
    options = OperatorOptions(
        sidecar_image=args.sidecar_image, native_sidecars=args.native_sidecars,
        webhook_host=args.webhook_host, webhook_port=args.webhook_port,
        webhook_cert=cert, webhook_key=key, warms_per_target=args.warms_per_target, metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        sidecar_auth=args.sidecar_auth, sidecar_auth_users=",".join(args.sidecar_auth_user),
        sidecar_token_file=args.sidecar_token_file, sidecar_protect_metrics=args.sidecar_protect_metrics,
        sidecar_token_service_account=args.sidecar_token_service_account,
        sidecar_metrics_users=",".join(args.sidecar_metrics_user),
        sidecar_tls=not args.sidecar_plain_http, control_ca_secret=args.control_ca_secret,
        network_policies=args.network_policies,
        operator_namespace=args.operator_namespace, operator_pod_labels=args.operator_pod_labels,
        monitoring_namespace=args.monitoring_namespace, serving_ports_open=not args.close_serving_ports,
    )
    os.environ.update(options.to_env())

    import kopf

    import kvtier_operator.handlers  # noqa: F401  (registers the handlers)

    if args.service_account_dir:
        _use_service_account_dir(args.service_account_dir)
    kopf.configure(verbose=args.verbose)
    kopf.run(
        clusterwide=not args.namespace, namespaces=args.namespace, standalone=True,
        liveness_endpoint=args.liveness, identity=operator_identity(),
    )
    return 0


def operator_identity() -> str:
    """kopf's identity for this process, without the user database: kopf's default asks
    getpwuid, which fails under an arbitrary uid with no passwd entry (the chart's
    non-root uid in an image that does not name it)."""
    import socket

    from kvtier_operator import names

    return f"kvtier-operator@{os.environ.get(names.POD_NAME_ENV) or socket.gethostname()}/{os.getpid()}"


# Above kopf's own service-account (20) and kubeconfig (10) logins: an explicit flag wins.
SERVICE_ACCOUNT_LOGIN_PRIORITY = 30


def _use_service_account_dir(directory: Path) -> None:
    """Point the client library's in-cluster loader (used by `Kube.from_environment`)
    and kopf's login at `directory` instead of the fixed in-pod path."""
    import kopf
    from kubernetes.config import incluster_config

    incluster_config.SERVICE_TOKEN_FILENAME = str(directory / "token")
    incluster_config.SERVICE_CERT_FILENAME = str(directory / "ca.crt")

    @kopf.on.login(id="service-account-dir")
    def login(**_: object) -> kopf.ConnectionInfo | None:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
        token = directory / "token"
        if not (host and port and token.is_file()):
            return None
        namespace = directory / "namespace"
        return kopf.ConnectionInfo(
            server=f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}",
            ca_path=str(directory / "ca.crt"), scheme="Bearer", token=token.read_text().strip(),
            default_namespace=namespace.read_text().strip() if namespace.is_file() else None,
            priority=SERVICE_ACCOUNT_LOGIN_PRIORITY,
        )


if __name__ == "__main__":
    sys.exit(main())
