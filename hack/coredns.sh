#!/usr/bin/env bash
# Builds, once, the CoreDNS binary kvtier's real-node test cluster runs as its cluster DNS
# (issue #22), and prints its path:
#
#   coredns   CoreDNS from the github.com/coredns/coredns Go module, built inside the
#             wrapper hack/coredns with only the plugins a test cluster needs (bind, ready,
#             health, prometheus, errors, log, loadbalance, cache, kubernetes, loop,
#             forward, whoami); see hack/coredns/main.go
#
# It lands in ${KVTIER_CACHE:-$HOME/.cache/kvtier}/coredns/<key>/coredns, where <key>
# names the CoreDNS version (read from the wrapper's go.mod), the Go toolchain, the
# platform and a digest of the wrapper (go.mod, go.sum, main.go), so a change to any of
# them builds afresh and a second run with none is a no-op.
#
# Usage:
#   hack/coredns.sh                print the binary's path last, building it if missing
#   hack/coredns.sh --print-path   print the binary's path without building (exit 0 even
#                                  when it is not built yet)
#
# GOTOOLCHAIN stays local so the build never downloads another Go; -mod=readonly so it
# never edits the wrapper's go.mod/go.sum; -trimpath, -buildvcs=false and -s -w so the
# binary depends only on the inputs the key names.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
wrapper=$root/hack/coredns
export GOTOOLCHAIN=local
export GOFLAGS="${GOFLAGS:-} -mod=readonly"

LOG_TAG=coredns
. "$root/hack/lib.sh"

command -v go >/dev/null 2>&1 || die "go is not installed (need Go >= 1.24 on PATH)"
COREDNS_VERSION=$(awk '$1 == "github.com/coredns/coredns" { print $2 } $1 == "require" && $2 == "github.com/coredns/coredns" { print $3 }' "$wrapper/go.mod")
[ -n "$COREDNS_VERSION" ] || die "no github.com/coredns/coredns requirement in $wrapper/go.mod"
read -r go_version goos goarch <<<"$(go env GOVERSION GOOS GOARCH | tr '\n' ' ')"
platform=$goos-$goarch
wrapper_digest=$(cat "$wrapper/go.mod" "$wrapper/go.sum" "$wrapper/main.go" | sha256sum | cut -c1-12)
key="${COREDNS_VERSION}_${go_version}_${platform}_${wrapper_digest}"
cache=${KVTIER_CACHE:-$HOME/.cache/kvtier}/coredns
dest=$cache/$key
binary=$dest/coredns

complete() { [ -f "$dest/.complete" ] && [ -x "$binary" ]; }

if [ "${1:-}" = "--print-path" ]; then
  echo "$binary"
  exit 0
elif [ $# -gt 0 ]; then
  echo "usage: $0 [--print-path]" >&2
  exit 2
fi

cached_or_lock complete "$binary"

work=$(mktemp -d "$cache/.build-XXXXXX")
trap 'rm -rf "$work"' EXIT
started=$(date +%s)

log "building CoreDNS ${COREDNS_VERSION} (Go ${go_version}; 764 packages, client-go among them)"
(cd "$wrapper" &&
  go build -v -trimpath -buildvcs=false -ldflags='-s -w' -o "$work/coredns" . 2>&1) |
  go_build_progress coredns 50 || die "CoreDNS build failed (see the go output above)"

# --- smoke check and publish ---------------------------------------------------------
"$work/coredns" -version >/dev/null || die "built coredns does not run"
plugins=$("$work/coredns" -plugins) || die "built coredns -plugins failed"
# (-plugins prints one plugin name a line; v1.12.4 also lists metadata, transfer,
# dnstap and debug: cache, kubernetes and forward import them, and without a directive
# they are registered but cannot be used in a Corefile.)
for p in bind ready health prometheus errors log loadbalance cache kubernetes loop forward whoami; do
  grep -qx "$p" <<<"$plugins" || die "built coredns lacks the $p plugin (coredns -plugins: $(echo $plugins))"
done

rm -rf "$dest"
mkdir -p "$dest"
mv "$work/coredns" "$binary"
{
  echo "coredns=${COREDNS_VERSION}"
  echo "go=${go_version}"
  echo "sha256=$(sha256sum "$binary" | cut -d' ' -f1)"
  echo "build_seconds=$(($(date +%s) - started))"
} > "$dest/.complete"
log "built in $(($(date +%s) - started))s: $binary"
echo "$binary"
