"""Running the real operator in tests: under `kopf.testing.KopfRunner`, with the
ServiceAccount token that operator/deploy/rbac.yaml grants (never the admin), its
webhook on 127.0.0.1 with a self-signed certificate, registered with the apiserver."""
from __future__ import annotations

import base64
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from kopf.testing import KopfRunner

from kvtier_operator import certs, crashpoints
from kvtier_operator.options import OperatorOptions
from kvtier_testenv import processes
from kvtier_testenv.kubectl import Kubectl
from kvtier_testenv import polling
from kvtier_testenv.ports import free_port
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


@contextlib.contextmanager
def operator_behind_its_webhook(namespace: str, operator_kubeconfig, control_plane, tmp_path: Path, monkeypatch):
    """An operator, not started yet, whose injection webhook is registered for this
    namespace on a free port. Yields (operator, port); on exit a started operator is
    stopped (its output must hold no traceback) and the webhook is deregistered."""
    admin = Kubectl(control_plane.kubeconfig)
    port = free_port()
    options = operator_options(tmp_path, port)
    hook = register_webhook(admin, namespace, open(options.webhook_cert, "rb").read(), port)
    op = RunningOperator(namespace, operator_kubeconfig, options, monkeypatch)
    try:
        yield op, port
    finally:
        if op.runner is not None:
            output = op.stop()
            assert "Traceback" not in output
        admin.delete("mutatingwebhookconfiguration", hook)


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


# The operator's console script, installed beside this interpreter.
OPERATOR_SCRIPT = os.path.join(os.path.dirname(sys.executable), "kvtier-operator")


def operator_argv(namespace: str, options: OperatorOptions) -> list[str]:
    """`kvtier-operator`'s command line for `options` (the console script the chart's
    image runs): the process builds its settings from its flags, so each option a test
    sets must travel as a flag, not as the env."""
    argv = [OPERATOR_SCRIPT, "--namespace", namespace,
            "--sidecar-auth", options.sidecar_auth, "--warms-per-target", str(options.warms_per_target),
            "--operator-namespace", options.operator_namespace, "--control-ca-secret", options.control_ca_secret]
    if not options.sidecar_tls:
        argv.append("--sidecar-plain-http")
    if options.webhook_host:
        argv += ["--webhook-host", options.webhook_host, "--webhook-port", str(options.webhook_port),
                 "--webhook-cert", str(options.webhook_cert), "--webhook-key", str(options.webhook_key)]
    return argv


# kopf's own shutdown (handlers cancelled, cleanup activity) takes a few seconds on a
# loaded box; past this the process is SIGKILLed.
STOP_TIMEOUT_S = 15
# A crash point is reached within a pass or two of the change that leads to it;
# generous for a loaded 2-core box.
CRASH_WAIT_S = 120


class OperatorProcess:
    """The operator as its own process (`kvtier-operator`, the ServiceAccount's
    kubeconfig), optionally set to die right after a crash point (KVTIER_CRASH_AT)."""

    def __init__(self, namespace: str, kubeconfig: Path, options: OperatorOptions, log_path: Path) -> None:
        self.namespace, self.kubeconfig, self.options, self.log_path = namespace, kubeconfig, options, log_path
        self.proc: subprocess.Popen | None = None

    def start(self, crash_at: str | None = None) -> "OperatorProcess":
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        env.pop(crashpoints.ENV, None)
        if crash_at:
            env[crashpoints.ENV] = crash_at
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(operator_argv(self.namespace, self.options), env=env, stdout=log, stderr=log)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self) -> str:
        return self.log()[-3000:]

    def sigkill(self) -> None:
        """Kill the process with no chance to clean up (no kopf shutdown, no lease release)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(STOP_TIMEOUT_S)

    def exit_code(self) -> int:
        """Wait for the process to end (a crash point reached) and return its status."""
        assert self.proc is not None
        return self.proc.wait(CRASH_WAIT_S)

    def webhook_listening(self) -> bool:
        """This process's injection webhook accepts connections: a pod created before
        that starts without the sidecar (the webhook fails open)."""
        try:
            socket.create_connection((self.options.webhook_host, self.options.webhook_port), timeout=1).close()
            return True
        except OSError:
            return False

    def stop(self) -> None:
        processes.stop(self.proc, STOP_TIMEOUT_S)


def operator_options(tmp_path: Path, webhook_port: int | None = None, **overrides: Any) -> OperatorOptions:
    # The node agent's sidecars have no ServiceAccount token to call TokenReview with
    # unless a test sets that up (tests/operator/test_control_auth_e2e.py does).
    overrides.setdefault("sidecar_auth", "open")
    # The control CA Secret lives in the operator's namespace (made by the first operator
    # of the session, reused by every later one, as after a restart).
    overrides.setdefault("operator_namespace", OPERATOR_NAMESPACE)
    knobs = {"debounce_s": 0.2, "resync_interval_s": 30, **overrides}
    if webhook_port is None:
        return OperatorOptions(**knobs)
    cert = certs.self_signed(tmp_path / "tls", ["127.0.0.1"])
    return OperatorOptions(webhook_host="127.0.0.1", webhook_port=webhook_port, webhook_cert=str(cert.cert),
                           webhook_key=str(cert.key), **knobs)


def events(kubectl: Kubectl, name: str, reason: str) -> list[dict[str, Any]]:
    items = kubectl.get_json("events", "--field-selector", f"involvedObject.name={name},reason={reason}")["items"]
    return items


