"""pytest fixtures over the real Kubernetes control plane (a pytest plugin).

- `control_plane` (session): etcd + kube-apiserver + kube-controller-manager, one per
  session; its logs go to a pytest temp dir and their tails are printed in the
  terminal summary when a test failed.
- `namespace` (function): a fresh namespace per test, deleted afterwards (without
  waiting: the namespace controller empties it in the background). The operator's
  finalizer on the test's policies goes first: the operator that would remove it
  stopped with the test, and a namespace left Terminating is retried by the namespace
  controller for the rest of the session (the apiserver's CPU grew with the backlog).
- `kubectl`, `helm` (function): the real binaries with the admin kubeconfig,
  bound to the test's namespace.
- `node_agent` (function): a node agent running the `kvtier-sidecar` containers of
  every pod in the test's namespace as local processes; `node_agent_factory` makes
  agents with other options (selector, container names, ...), all stopped after.
- `api_client` (session): a `kubernetes.client.ApiClient` for the admin user.

Any test that uses `control_plane` (directly or through these) gets the `k8s` marker.
Missing binaries make these fixtures error with the fix (run scripts/setup.sh); they
never skip.
"""
from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvtier import names, policy
from kvtier_testenv.controlplane import ControlPlane
from kvtier_testenv.kubeapi import ApiError, RestClient
from kvtier_testenv.kubectl import Helm, Kubectl
from kvtier_testenv.nodeagent import NodeAgent

_started: list[ControlPlane] = []
# Kubernetes names are DNS labels: 63 characters at most.
_NAMESPACE_MAX = 63


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "control_plane" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.k8s)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    cp = ControlPlane(controller_manager=True, log_dir=tmp_path_factory.mktemp("controlplane-logs"))
    cp.start()
    _started.append(cp)
    try:
        yield cp
    finally:
        cp.stop()


def namespace_name(test_name: str) -> str:
    """`t-<test name as a DNS label>-<6 hex>`, unique per call."""
    slug = re.sub(r"[^a-z0-9-]+", "-", test_name.lower()).strip("-")
    suffix = uuid.uuid4().hex[:6]
    return f"t-{slug[: _NAMESPACE_MAX - len(suffix) - 3].rstrip('-')}-{suffix}"


@pytest.fixture(scope="session")
def _admin_rest(control_plane: ControlPlane) -> RestClient:
    return RestClient(control_plane.kubeconfig)


def release_operator_finalizers(rest: RestClient, namespace: str) -> None:
    """Take the operator's finalizer off every KVCachePolicy in `namespace` (what an
    admin does once the operator is gone); nothing to do without the CRD."""
    base = f"/apis/{policy.GROUP}/{policy.VERSION}/namespaces/{namespace}/{policy.PLURAL}"
    try:
        items = rest.request("GET", base)["items"]
    except ApiError as exc:
        if exc.status == 404:  # no CRD in this session (yet)
            return
        raise
    for item in items:
        finalizers = item["metadata"].get("finalizers") or []
        if names.FINALIZER in finalizers:
            keep = [f for f in finalizers if f != names.FINALIZER]
            try:
                rest.request("PATCH", f"{base}/{item['metadata']['name']}",
                             {"metadata": {"finalizers": keep or None}}, "application/merge-patch+json")
            except ApiError as exc:
                if exc.status != 404:  # gone meanwhile: nothing to release
                    raise


@pytest.fixture
def namespace(control_plane: ControlPlane, _admin_rest: RestClient, request: pytest.FixtureRequest) -> Iterator[str]:
    name = namespace_name(request.node.name)
    admin = Kubectl(control_plane.kubeconfig)
    admin.run("create", "namespace", name)
    try:
        yield name
    finally:
        # The test's operator (a fixture torn down before this one) is gone by now.
        try:
            release_operator_finalizers(_admin_rest, name)
        except (ApiError, OSError):
            pass  # hygiene only (an apiserver a test left down): the namespace then lingers
        admin.delete("namespace", name, wait=False)


@pytest.fixture
def kubectl(control_plane: ControlPlane, namespace: str) -> Kubectl:
    return Kubectl(control_plane.kubeconfig, namespace=namespace)


@pytest.fixture
def helm(control_plane: ControlPlane, namespace: str, tmp_path) -> Helm:
    return Helm(control_plane.kubeconfig, namespace=namespace, home=tmp_path / "helm")


@pytest.fixture
def node_agent_factory(control_plane: ControlPlane, namespace: str) -> Iterator[Callable[..., NodeAgent]]:
    agents: list[NodeAgent] = []

    def make(**kwargs: Any) -> NodeAgent:
        kwargs.setdefault("namespaces", [namespace])
        agent = NodeAgent(control_plane.kubeconfig, **kwargs).start()
        agents.append(agent)
        return agent

    try:
        yield make
    finally:
        for agent in reversed(agents):
            agent.stop()


@pytest.fixture
def node_agent(node_agent_factory: Callable[..., NodeAgent]) -> NodeAgent:
    return node_agent_factory()


@pytest.fixture(scope="session")
def api_client(control_plane: ControlPlane) -> Iterator[Any]:
    from kubernetes import config  # imported lazily: ~1 s, only for tests that want it

    client = config.new_client_from_config(config_file=str(control_plane.kubeconfig))
    try:
        yield client
    finally:
        client.close()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int) -> None:
    if exitstatus == 0 or not _started:
        return
    for cp in _started:
        terminalreporter.section("kvtier control plane logs (tails)")
        terminalreporter.write_line(cp.describe_logs(lines=30) if cp.logs() else f"logs in {cp.log_dir}")
