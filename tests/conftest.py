"""Shared fixtures come from the test-environment plugins, so the demo can reuse them.

- kvtier_testenv.redis_fixtures: a real redis-server on a free loopback port.
- kvtier_testenv.k8s_fixtures: a real kube-apiserver + etcd (+ controller-manager),
  the node agent, per-test namespaces, the real kubectl and helm.
- kvtier_testenv.prometheus_fixtures: a real Prometheus (discovering the test's pods
  through the apiserver, loaded with the chart's alert rules) and Alertmanager.
A test that needs one of these fails loudly when it is missing; nothing is skipped.
"""

pytest_plugins = [
    "kvtier_testenv.redis_fixtures",
    "kvtier_testenv.k8s_fixtures",
    "kvtier_testenv.prometheus_fixtures",
]
