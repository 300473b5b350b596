#!/usr/bin/env bash
# Builds, once, kvtier's Endpoint Picker (router/epp: the Gateway API Inference
# Extension's EPP with kvtier's plugins compiled in) and the tests' gateway stand-in
# (router/epp/cmd/extproc-gateway: the ext_proc client tests/router drives it with), and
# prints the EPP binary's path:
#
#   ${KVTIER_CACHE:-$HOME/.cache/kvtier}/epp/<key>/kvtier-epp
#   ${KVTIER_CACHE:-$HOME/.cache/kvtier}/epp/<key>/extproc-gateway
#
# <key> names the EPP module's version, the Go toolchain, the platform and a digest
# of router/epp and router/affinity's sources and go.mod/go.sum, so a change to any
# of them builds afresh and a second run with none is a no-op. The build takes its
# modules from the Go module proxy (exact versions, as go.sum pins them).
#
# Usage:
#   hack/epp.sh              build if missing; print the binary's path last
#   hack/epp.sh --print-bin  print the path without building (exit 0 even when absent)
#   hack/epp.sh --print-dir  print the directory holding both, likewise
#
# On a shared machine: GOFLAGS=-p=1 nice -n 5 hack/epp.sh
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
mod=$root/router/epp
export GOTOOLCHAIN=local
export GOFLAGS="${GOFLAGS:-} -mod=readonly -buildvcs=false"

LOG_TAG=epp
. "$root/hack/lib.sh"

command -v go >/dev/null 2>&1 || die "go is not installed (need Go >= 1.25 on PATH)"
go_version=$(go env GOVERSION)
platform=$(go env GOOS)-$(go env GOARCH)
gie_version=$(cd "$mod" && go list -m -f '{{.Version}}' sigs.k8s.io/gateway-api-inference-extension)
src_digest=$(cd "$root/router" && find epp affinity -type f \( -name '*.go' -o -name 'go.mod' -o -name 'go.sum' \) \
  ! -name '*_test.go' -print0 | LC_ALL=C sort -z | xargs -0 cat go.mod go.sum | sha256sum | cut -c1-12)
key="gie-${gie_version}_${go_version}_${platform}_${src_digest}"
cache=${KVTIER_CACHE:-$HOME/.cache/kvtier}/epp
dest=$cache/$key
bin=$dest/kvtier-epp
gateway=$dest/extproc-gateway

if [ "${1:-}" = "--print-bin" ]; then
  echo "$bin"
  exit 0
elif [ "${1:-}" = "--print-dir" ]; then
  echo "$dest"
  exit 0
elif [ $# -gt 0 ]; then
  echo "usage: $0 [--print-bin|--print-dir]" >&2
  exit 2
fi

complete() { [ -f "$dest/.complete" ] && [ -x "$bin" ] && [ -x "$gateway" ]; }

cached_or_lock complete "$bin"

work=$(mktemp -d "$cache/.build-XXXXXX")
trap 'rm -rf "$work"' EXIT
started=$(date +%s)
log "building kvtier-epp (EPP ${gie_version}, Go ${go_version}); ~1200 packages, ~11 min on one core when cold"
(cd "$mod" && go build -v -trimpath -ldflags='-s -w' -o "$work/kvtier-epp" ./cmd/kvtier-epp 2>&1) |
  go_build_progress kvtier-epp 50
[ "${PIPESTATUS[0]}" -eq 0 ] || die "kvtier-epp build failed (see the go output above)"
"$work/kvtier-epp" --help >/dev/null 2>&1 || die "built kvtier-epp does not run"
(cd "$mod" && go build -trimpath -ldflags='-s -w' -o "$work/extproc-gateway" ./cmd/extproc-gateway) ||
  die "extproc-gateway build failed (see the go output above)"

rm -rf "$dest"
mkdir -p "$dest"
mv "$work/kvtier-epp" "$bin"
mv "$work/extproc-gateway" "$gateway"
seconds=$(($(date +%s) - started))
{
  echo "gateway-api-inference-extension=${gie_version}"
  echo "go=${go_version}"
  echo "build_seconds=${seconds}"
} > "$dest/.complete"
log "built in ${seconds}s: $bin"
echo "$bin"
