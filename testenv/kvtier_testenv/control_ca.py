"""The operator's control CA, provisioned ahead of the operator the way a platform team
brings its own: the Secret `<operator namespace>/kvtier-control-ca` (ca.crt, ca.key)
created once, which every operator started later reuses. Tests and the demo do this so
that what must trust the CA before any operator runs (a Prometheus scrape job's
ca_file) has it."""
from __future__ import annotations

import base64
import datetime as dt
from pathlib import Path

from kvtier_operator import control_ca
from kvtier_operator.options import DEFAULT_CONTROL_CA_SECRET
from kvtier_testenv.kubectl import Kubectl, KubectlError

# Where operator/deploy and the tests run the operator (the chart's release namespace there).
OPERATOR_NAMESPACE = "kvtier-system"


def provision(admin: Kubectl, namespace: str, name: str = DEFAULT_CONTROL_CA_SECRET) -> bytes:
    """The CA certificate (PEM) in `namespace/name`, made now if the Secret is absent."""
    admin.run("create", "namespace", namespace, check=False)
    ns = admin.in_namespace(namespace)
    got = ns.run("get", "secret", name, "-o", "json", check=False)
    if got.returncode != 0:
        pair = control_ca.new_ca(dt.datetime.now(dt.timezone.utc))
        try:
            ns.create({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                       "metadata": {"name": name, "namespace": namespace},
                       "data": {control_ca.CA_CERT_KEY: base64.b64encode(pair.cert_pem).decode(),
                                control_ca.CA_KEY_KEY: base64.b64encode(pair.key_pem).decode()}})
        except KubectlError:  # made meanwhile by someone else: theirs is the CA
            pass
    data = ns.get_json("secret", name)["data"]
    return base64.b64decode(data[control_ca.CA_CERT_KEY])


def provision_file(admin: Kubectl, namespace: str, path: Path, name: str = DEFAULT_CONTROL_CA_SECRET) -> Path:
    path.write_bytes(provision(admin, namespace, name))
    return path
