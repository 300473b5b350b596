#!/usr/bin/env bash
# The test command: set up (idempotent, cached), then run the whole suite against the
# real components (redis-server, kube-apiserver + etcd, kubelet + containerd, kubectl,
# helm, Prometheus, vLLM, the Endpoint Picker).
#
# The suite runs on two pytest-xdist workers: the work units that share a host resource
# (the real-node cluster; fixed loopback addresses) each run whole on one worker, every
# other test module is a unit of its own (tests/conftest.py, `pytest_xdist_make_scheduler`).
# KVTIER_TEST_WORKERS=0 runs it in this one process; arguments go to pytest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
workers=${KVTIER_TEST_WORKERS:-2}
if [ "$workers" = 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
exec .venv/bin/python -m pytest -n "$workers" "$@"
