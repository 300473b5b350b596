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
    # `kubectl wait` errors out (not waits) while the new CRD has no status.conditions yet.
    polling.wait_for("CRD Established", lambda: admin.run(
        "wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=10s", check=False).returncode == 0, 60.0, 0.2)
    return CRD_NAME


@pytest.fixture(scope="session")
def operator_kubeconfig(control_plane, kvcp_crd):
    """A kubeconfig for the operator's ServiceAccount, bound to operator/deploy/rbac.yaml."""
    from operator_harness import DEPLOY, OPERATOR_NAMESPACE, OPERATOR_SA

    Kubectl(control_plane.kubeconfig).apply(DEPLOY / "rbac.yaml")
    return control_plane.kubeconfig_for_service_account(OPERATOR_NAMESPACE, OPERATOR_SA)
