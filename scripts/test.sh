#!/usr/bin/env bash
# The test command: set up (idempotent, cached), then run the whole suite against the
# real components (redis-server, kube-apiserver + etcd, kubectl, helm).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
