"""Shared fixtures come from the test-environment plugins, so the demo can reuse them.

- kvtier_testenv.redis_fixtures: a real redis-server on a free loopback port.
- kvtier_testenv.k8s_fixtures: a real kube-apiserver + etcd (+ controller-manager),
  the node agent, per-test namespaces, the real kubectl and helm.
A test that needs one of these fails loudly when it is missing; nothing is skipped.
"""

pytest_plugins = [
    "kvtier_testenv.redis_fixtures",
    "kvtier_testenv.k8s_fixtures",
]
