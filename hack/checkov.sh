#!/usr/bin/env bash
# checkov (the chart's static security lint) in a venv of its own under the kvtier
# cache: its dependency tree is large and pins versions kvtier's own venv should not
# have to agree with.
#
#   bash hack/checkov.sh               install once (idempotent)
#   bash hack/checkov.sh --print-bin   the checkov executable's path
set -euo pipefail

CHECKOV_VERSION=3.3.30
cache=${KVTIER_CACHE:-$HOME/.cache/kvtier}
venv=$cache/checkov-$CHECKOV_VERSION
bin=$venv/bin/checkov

if [ "${1:-}" = "--print-bin" ]; then
  echo "$bin"
  exit 0
fi
if [ -x "$bin" ] && [ -f "$venv/.installed" ]; then
  exit 0
fi
echo "[checkov] installing checkov $CHECKOV_VERSION into $venv" >&2
rm -rf "$venv"
"${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "checkov==$CHECKOV_VERSION"
touch "$venv/.installed"
