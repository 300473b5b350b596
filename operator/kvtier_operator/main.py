"""`kvtier-operator`: run the KVCachePolicy operator (kopf) with kvtier's settings.

    kvtier-operator [--namespace NS ...] [--sidecar-image IMG]
                    [--webhook-host HOST --webhook-port PORT (--webhook-cert F --webhook-key F
                     | --webhook-self-signed DIR)] [--warms-per-target N] [--liveness URL]
                    [--service-account-dir DIR] [--verbose] [one flag per setting ...]

The settings' flags (and the env they travel in to the kopf handlers) are generated
from `options.OperatorOptions`: `kvtier-operator --help` lists them.

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

from pydantic import ValidationError

from kvtier_operator.options import OperatorOptions


def _parser() -> argparse.ArgumentParser:
    """The run's own flags, then one per setting (`OperatorOptions.add_flags`)."""
    p = argparse.ArgumentParser(prog="kvtier-operator", description=__doc__.split("\n\n")[0])
    p.add_argument("--namespace", action="append", default=[], help="watch only this namespace (repeatable)")
    p.add_argument("--webhook-self-signed", type=Path, metavar="DIR",
                   help="make a self-signed certificate in DIR (its cert.pem is the webhook's caBundle)")
    p.add_argument("--liveness", help="serve kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--service-account-dir", type=Path, metavar="DIR",
                   help="in-cluster credentials (token, ca.crt, namespace) mounted here")
    p.add_argument("--verbose", action="store_true")
    OperatorOptions.add_flags(p)
    return p


def _refusal(args: argparse.Namespace, options: OperatorOptions) -> str | None:
    """What is wrong with the flags taken together; None when nothing is."""
    if (options.webhook_cert is None) != (options.webhook_key is None):
        return "--webhook-cert and --webhook-key go together"
    if (options.webhook_cert or args.webhook_self_signed) and not options.webhook_host:
        return "--webhook-host is required with a webhook certificate"
    labels_given = hasattr(args, "operator_pod_labels") and options.operator_pod_labels
    if options.network_policies and not (options.operator_namespace and labels_given):
        return "--network-policies needs --operator-namespace and --operator-pod-labels"
    if options.sidecar_tls and not options.operator_namespace:
        return ("--operator-namespace is required: the sidecars' control CA Secret lives there "
                "(or --sidecar-plain-http, a loopback lab only)")
    if options.sidecar_token_service_account and options.sidecar_token_service_account.count("/") != 1:
        return "--sidecar-token-service-account is NAMESPACE/NAME"
    if options.warms_per_target < 1:
        return "--warms-per-target must be at least 1"
    return None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        options = OperatorOptions.from_args(args)
    except ValidationError as exc:
        print(f"kvtier-operator: {exc}", file=sys.stderr)
        return 2
    refusal = _refusal(args, options)
    if refusal:
        print(f"kvtier-operator: {refusal}", file=sys.stderr)
        return 2
    if args.webhook_self_signed:
        from kvtier_operator import certs

        made = certs.self_signed(args.webhook_self_signed, [options.webhook_host])
        options = OperatorOptions.from_args(args, webhook_cert=str(made.cert), webhook_key=str(made.key))
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
