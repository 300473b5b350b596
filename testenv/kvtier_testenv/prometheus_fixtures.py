"""pytest fixtures over a real Prometheus and Alertmanager (a pytest plugin).

- `alertmanager` (session): one Alertmanager on a free loopback port.
- `prometheus_factory` (function): `make(operator_targets=[...], rules=...)` starts a
  Prometheus discovering the test namespace's injected sidecars through the real
  kube-apiserver (pods: get/list/watch only), with the chart's rules rendered for tests
  and alerts sent to the session's Alertmanager; every one is stopped after the test.
- `prometheus`: `prometheus_factory()` with no operator target.
- `control_ca_file` (session): the operators' control CA, provisioned ahead of them
  (`control_ca.provision`): the sidecars' scrape job trusts it.

A missing binary fails loudly (RuntimeError naming scripts/setup.sh); nothing skips.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvtier_testenv import control_ca
from kvtier_testenv.kubectl import Kubectl
from kvtier_testenv.prometheus import (
    Alertmanager, Prometheus, TEST_RULE_VALUES, chart_rules, grant_discovery, operator_scrape_config, sidecar_scrape_config,
)


@pytest.fixture(scope="session")
def alertmanager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Alertmanager]:
    am = Alertmanager(tmp_path_factory.mktemp("alertmanager")).start()
    try:
        yield am
    finally:
        am.stop()


@pytest.fixture(scope="session")
def discovery_kubeconfig(control_plane) -> Any:
    return grant_discovery(control_plane, Kubectl(control_plane.kubeconfig))


@pytest.fixture(scope="session")
def control_ca_file(control_plane, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The operators' control CA (provisioned once; every operator of the session reuses
    it), as the file a scrape job trusts."""
    return control_ca.provision_file(Kubectl(control_plane.kubeconfig), control_ca.OPERATOR_NAMESPACE,
                                     tmp_path_factory.mktemp("control-ca") / "ca.crt")


@pytest.fixture
def prometheus_factory(discovery_kubeconfig, control_ca_file, namespace: str, alertmanager: Alertmanager,
                       tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Prometheus]]:
    started: list[Prometheus] = []

    def make(operator_targets: list[str] | None = None, rules: str | None = None) -> Prometheus:
        jobs = [sidecar_scrape_config(discovery_kubeconfig, [namespace], control_ca_file)]
        if operator_targets:
            jobs.append(operator_scrape_config(operator_targets))
        prom = Prometheus(tmp_path_factory.mktemp("prometheus"))
        prom.configure(jobs, chart_rules(TEST_RULE_VALUES) if rules is None else rules, alertmanager.address)
        started.append(prom)
        return prom.start()

    try:
        yield make
    finally:
        for prom in started:
            prom.stop()


@pytest.fixture
def prometheus(prometheus_factory: Callable[..., Prometheus]) -> Prometheus:
    return prometheus_factory()
