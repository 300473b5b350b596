"""Native sidecar injection: on Kubernetes >= 1.29 the sidecar is the last init
container with restartPolicy Always and a /healthz startupProbe (kubelet starts it
before the engine and stops it after); older API servers, or `never`, get the plain
container. Pure: the patch the webhook returns."""
from __future__ import annotations

import pytest
import yaml

from kvtier import policy
from kvtier_operator import injection, names
from operator_cases import EXAMPLES_DIR


@pytest.fixture
def spec() -> policy.KVCachePolicySpec:
    return policy.parse_policy(yaml.safe_load((EXAMPLES_DIR / "minimal.yaml").read_text())).spec


def pod(init: list | None = None) -> dict:
    spec = {"containers": [{"name": "engine", "image": "e"}]}
    if init is not None:
        spec["initContainers"] = init
    return {"metadata": {"name": "p", "labels": {}}, "spec": spec}


@pytest.mark.parametrize(("major", "minor", "native"), [
    ("1", "29", True), ("1", "33", True), ("1", "30+", True), ("2", "0", True),
    ("1", "28", False), ("1", "28+", False), ("1", "", False), ("", "", False),
])
def test_native_sidecars_from_the_api_servers_version(major, minor, native):
    assert injection.supports_native_sidecars(major, minor) is native


def test_native_sidecar_is_the_last_init_container_restarting_always(spec):
    first = {"name": "fetch-weights", "image": "w"}
    patch = injection.inject(pod([first]), "minimal", spec, injection.SidecarImage(native=True))
    containers, init = patch["spec"]["containers"], patch["spec"]["initContainers"]
    assert [c["name"] for c in containers] == ["engine"]
    assert [c["name"] for c in init] == ["fetch-weights", names.SIDECAR_CONTAINER]
    sidecar = init[-1]
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # the engine still shares the arena and socket volumes with it
    engine_mounts = {m["mountPath"] for m in containers[0]["volumeMounts"]}
    sidecar_mounts = {m["mountPath"] for m in sidecar["volumeMounts"]}
    assert {names.SHM_MOUNT_PATH, names.RUN_MOUNT_PATH} <= engine_mounts & sidecar_mounts


def test_plain_container_without_native_and_no_second_injection(spec):
    patch = injection.inject(pod(), "minimal", spec, injection.SidecarImage(native=False))
    assert "initContainers" not in patch["spec"]
    assert [c["name"] for c in patch["spec"]["containers"]] == ["engine", names.SIDECAR_CONTAINER]
    assert "restartPolicy" not in patch["spec"]["containers"][-1]
    native = injection.inject(pod(), "minimal", spec, injection.SidecarImage(native=True))
    injected = pod(native["spec"]["initContainers"])
    assert injection.inject(injected, "minimal", spec, injection.SidecarImage(native=True)) is None
