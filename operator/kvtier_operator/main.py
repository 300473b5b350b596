"""`kvtier-operator`: run the KVCachePolicy operator (kopf) with kvtier's settings.

    kvtier-operator [--namespace NS ...] [--sidecar-image IMG]
                    [--webhook-host HOST --webhook-port PORT (--webhook-cert F --webhook-key F
                     | --webhook-self-signed DIR)] [--liveness URL] [--verbose]

Without --namespace it watches all namespaces. Without --webhook-host it serves no
admission webhook (sidecar injection off). One replica only (Recreate): the operator
keeps per-policy state in the objects' status and `kvtier.io/` annotations.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvtier_operator.options import OperatorOptions


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier-operator", description=__doc__.split("\n\n")[0])
    p.add_argument("--namespace", action="append", default=[], help="watch only this namespace (repeatable)")
    p.add_argument("--sidecar-image", default=OperatorOptions.sidecar_image, help="image of the injected sidecar")
    p.add_argument("--webhook-host", help="address the webhook listens on and the apiserver reaches it by")
    p.add_argument("--webhook-port", type=int, default=OperatorOptions.webhook_port)
    p.add_argument("--webhook-cert", help="PEM serving certificate (e.g. mounted from a Secret)")
    p.add_argument("--webhook-key", help="PEM private key of --webhook-cert")
    p.add_argument("--webhook-self-signed", type=Path, metavar="DIR",
                   help="make a self-signed certificate in DIR (its cert.pem is the webhook's caBundle)")
    p.add_argument("--liveness", help="serve kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz")
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
    cert, key = args.webhook_cert, args.webhook_key
    if args.webhook_self_signed:
        from kvtier_operator import certs

        made = certs.self_signed(args.webhook_self_signed, [args.webhook_host])
        cert, key = str(made.cert), str(made.key)
    options = OperatorOptions(
        sidecar_image=args.sidecar_image, webhook_host=args.webhook_host, webhook_port=args.webhook_port,
        webhook_cert=cert, webhook_key=key,
    )
    os.environ.update(options.to_env())

    import kopf

    import kvtier_operator.handlers  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=args.verbose)
    kopf.run(
        clusterwide=not args.namespace, namespaces=args.namespace, standalone=True,
        liveness_endpoint=args.liveness,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
