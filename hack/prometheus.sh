#!/usr/bin/env bash
# Builds, once, the Prometheus server kvtier's tests and demo run: Prometheus from its
# Go module (github.com/prometheus/prometheus, inside the wrapper hack/prometheus) with
# Kubernetes service discovery, which Debian's `prometheus` package does not include.
# promtool and Alertmanager come from Debian (scripts/setup.sh).
#
# The binary lands in ${KVTIER_CACHE:-$HOME/.cache/kvtier}/prometheus/<key>/prometheus,
# <key> naming the module version, the Go toolchain, the platform and a digest of the
# wrapper, so a change to any of them builds afresh and a second run is a no-op.
#
# Usage:
#   hack/prometheus.sh                 build if missing; print the binary's path last
#   hack/prometheus.sh --print-path    print the path without building
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
wrapper=$root/hack/prometheus
export GOTOOLCHAIN=local
export GOFLAGS="${GOFLAGS:-} -mod=readonly"
# Only the discovery mechanisms kvtier uses: a third of the full build.
TAGS=remove_all_sd,enable_kubernetes_sd

LOG_TAG=prometheus
. "$root/hack/lib.sh"

command -v go >/dev/null 2>&1 || die "go is not installed (need Go >= 1.26 on PATH)"
version=$(awk '$1 == "require" && $2 == "github.com/prometheus/prometheus" {print $3}' "$wrapper/go.mod")
[ -n "$version" ] || die "hack/prometheus/go.mod does not require github.com/prometheus/prometheus"
digest=$(cat "$wrapper/go.mod" "$wrapper/go.sum" | sha256sum | cut -c1-12)
key="prometheus-${version}_$(go env GOVERSION)_$(go env GOOS)-$(go env GOARCH)_${digest}"
cache=${KVTIER_CACHE:-$HOME/.cache/kvtier}/prometheus
dest=$cache/$key

if [ "${1:-}" = "--print-path" ]; then
  echo "$dest/prometheus"
  exit 0
elif [ $# -gt 0 ]; then
  echo "usage: $0 [--print-path]" >&2
  exit 2
fi
built() { [ -x "$dest/prometheus" ]; }
cached_or_lock built "$dest/prometheus"
work=$(mktemp -d "$cache/.build-XXXXXX")
trap 'rm -rf "$work"' EXIT
started=$(date +%s)
log "building Prometheus ${version} with Kubernetes discovery (several minutes on 2 cores)"
(cd "$wrapper" && go build -trimpath -tags "$TAGS" -ldflags='-s -w' -o "$work/prometheus" \
  github.com/prometheus/prometheus/cmd/prometheus) || die "Prometheus build failed (see the go output above)"
"$work/prometheus" --version >/dev/null || die "built prometheus does not run"
mkdir -p "$dest"
mv "$work/prometheus" "$dest/prometheus"
log "built in $(($(date +%s) - started))s: $dest/prometheus"
echo "$dest/prometheus"
