#!/usr/bin/env bash
# The set-up-and-run command: installs everything (idempotent, cached), then runs the
# kvtier demo on an embedded local default. Extra arguments go to `kvtier demo`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
exec .venv/bin/kvtier demo "$@"
