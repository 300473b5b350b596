#!/usr/bin/env bash
# The set-up-and-run command: installs everything (idempotent, cached), then runs the
# demo on an embedded local default (the cluster demo; `--mode fleet` or `--mode local`
# for less). Extra arguments go to the checkout's demo, `python -m kvtier_testenv.demo`:
# its cluster and fleet modes run the test environment's components, which the wheel's
# `kvtier demo` (the local mode only) does not ship.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
exec .venv/bin/python -m kvtier_testenv.demo "$@"
