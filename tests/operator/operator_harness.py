"""Running the real operator in tests: under `kopf.testing.KopfRunner`, with the
ServiceAccount token that operator/deploy/rbac.yaml grants (never the admin), its
webhook on 127.0.0.1 with a self-signed certificate, registered with the apiserver."""
from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from kopf.testing import KopfRunner

from kvtier_operator import certs
from kvtier_operator.options import OperatorOptions
from kvtier_testenv.kubectl import Kubectl
from kvtier_testenv import polling
from operator_cases import ROOT

DEPLOY = ROOT / "operator" / "deploy"
OPERATOR_NAMESPACE = "kvtier-system"
OPERATOR_SA = "kvtier-operator"


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float = 30.0, interval_s: float = 0.1) -> Any:
    """Poll `probe` until it returns something truthy; fail naming `what` and the last value."""
    return polling.wait_for(what, probe, timeout_s, interval_s)


def register_webhook(admin: Kubectl, namespace: str, ca_pem: bytes, port: int) -> str:
    """deploy/webhook.yaml, pointed at 127.0.0.1:port and scoped to one test namespace."""
    cfg = yaml.safe_load((DEPLOY / "webhook.yaml").read_text().replace("${CA_BUNDLE}", ""))
    cfg["metadata"]["name"] = f"kvtier-injector-{namespace}"
    hook = cfg["webhooks"][0]
    hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}/inject-sidecar",
                            "caBundle": base64.b64encode(ca_pem).decode()}
    hook["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
    admin.apply(cfg)
    return cfg["metadata"]["name"]


class RunningOperator:
    """Start/stop the operator in-process; each start is a fresh kopf run (a restart)."""

    def __init__(self, namespace: str, kubeconfig: Path, options: OperatorOptions, monkeypatch):
        self.namespace = namespace
        self.kubeconfig = kubeconfig
        self.options = options
        self.monkeypatch = monkeypatch
        self.runner: KopfRunner | None = None

    def start(self) -> "RunningOperator":
        self.monkeypatch.setenv("KUBECONFIG", str(self.kubeconfig))
        for key, value in self.options.to_env().items():
            self.monkeypatch.setenv(key, value)
        self.runner = KopfRunner(
            ["run", "--standalone", "--namespace", self.namespace, "-m", "kvtier_operator.handlers"],
            timeout=60,
        )
        self.runner.__enter__()
        return self

    def stop(self) -> str:
        assert self.runner is not None
        runner, self.runner = self.runner, None
        runner.__exit__(None, None, None)
        if runner.exception is not None:
            raise runner.exception
        return runner.output


def operator_options(tmp_path: Path, webhook_port: int | None = None, **overrides: Any) -> OperatorOptions:
    # The node agent's sidecars have no ServiceAccount token to call TokenReview with
    # unless a test sets that up (tests/operator/test_control_auth_e2e.py does).
    overrides.setdefault("sidecar_auth", "open")
    knobs = {"debounce_s": 0.2, "resync_interval_s": 30, **overrides}
    if webhook_port is None:
        return OperatorOptions(**knobs)
    cert = certs.self_signed(tmp_path / "tls", ["127.0.0.1"])
    return OperatorOptions(webhook_host="127.0.0.1", webhook_port=webhook_port, webhook_cert=str(cert.cert),
                           webhook_key=str(cert.key), **knobs)


def events(kubectl: Kubectl, name: str, reason: str) -> list[dict[str, Any]]:
    items = kubectl.get_json("events", "--field-selector", f"involvedObject.name={name},reason={reason}")["items"]
    return items


