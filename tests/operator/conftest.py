"""Fixtures for the operator tests: the CRD installed once per session on the real
control plane (applied with the real kubectl, then waited on until Established)."""
from __future__ import annotations

import pytest

from kvtier_testenv.kubectl import Kubectl
from operator_cases import CRDS_DIR

CRD_NAME = "kvcachepolicies.kvtier.io"


@pytest.fixture(scope="session")
def kvcp_crd(control_plane) -> str:
    admin = Kubectl(control_plane.kubeconfig)
    admin.run("apply", "-f", str(CRDS_DIR))
    admin.run("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
    return CRD_NAME
