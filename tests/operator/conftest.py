"""Fixtures for the operator tests: the CRD installed once per session on the real
control plane (applied with the real kubectl, then waited on until Established)."""
from __future__ import annotations

import pytest

from kvtier_testenv import polling
from kvtier_testenv.kubectl import Kubectl
from operator_cases import CRDS_DIR

CRD_NAME = "kvcachepolicies.kvtier.io"


@pytest.fixture(scope="session")
def kvcp_crd(control_plane) -> str:
    admin = Kubectl(control_plane.kubeconfig)
    admin.run("apply", "-f", str(CRDS_DIR))
    # Polled rather than `kubectl wait`: that errors when it reads the CRD before the
    # apiserver wrote any condition at all.
    polling.wait_for(f"CRD {CRD_NAME} Established", lambda: any(
        c.get("type") == "Established" and c.get("status") == "True"
        for c in (admin.get_json("crd", CRD_NAME).get("status") or {}).get("conditions") or []), timeout_s=60)
    return CRD_NAME


@pytest.fixture(scope="session")
def operator_kubeconfig(control_plane, kvcp_crd):
    """A kubeconfig for the operator's ServiceAccount, bound to operator/deploy/rbac.yaml."""
    from operator_harness import DEPLOY, OPERATOR_NAMESPACE, OPERATOR_SA

    Kubectl(control_plane.kubeconfig).apply(DEPLOY / "rbac.yaml")
    return control_plane.kubeconfig_for_service_account(OPERATOR_NAMESPACE, OPERATOR_SA)


@pytest.fixture
def operator_process(namespace, operator_kubeconfig, control_plane, tmp_path):
    """The operator as its own process (not started yet), its webhook registered for
    the test's namespace: tests start, crash and restart it."""
    from kvtier_testenv.ports import free_port
    from operator_harness import OperatorProcess, operator_options, register_webhook

    admin = Kubectl(control_plane.kubeconfig)
    port = free_port()
    options = operator_options(tmp_path, port)
    hook = register_webhook(admin, namespace, open(options.webhook_cert, "rb").read(), port)
    op = OperatorProcess(namespace, operator_kubeconfig, options, tmp_path / "operator.log")
    yield op
    op.stop()
    admin.delete("mutatingwebhookconfiguration", hook)


@pytest.fixture
def operator(namespace, operator_kubeconfig, control_plane, tmp_path, monkeypatch, request):
    """The operator in this process (kopf's runner), its webhook registered for the
    test's namespace; `request.param` (indirect parametrize) overrides its options."""
    from kvtier_testenv.ports import free_port
    from operator_harness import RunningOperator, operator_options, register_webhook

    port = free_port()
    options = operator_options(tmp_path, port, **getattr(request, "param", {}))
    hook = register_webhook(Kubectl(control_plane.kubeconfig), namespace, open(options.webhook_cert, "rb").read(), port)
    op = RunningOperator(namespace, operator_kubeconfig, options, monkeypatch).start()
    yield op
    if op.runner is not None:
        op.stop()
    Kubectl(control_plane.kubeconfig).delete("mutatingwebhookconfiguration", hook)
