#!/usr/bin/env bash
# Builds, once, llm-d's precise prefix-cache producer as the tests run it
# (router/llmd-index: llm-d-kv-cache's KV-event pool, vLLM adapter, in-memory index and
# longest-prefix scorer, unmodified, behind a loopback query endpoint), and prints the
# binary's path:
#
#   ${KVTIER_CACHE:-$HOME/.cache/kvtier}/llmd-index/<key>/llmd-index
#
# <key> names llm-d-kv-cache's version, the Go toolchain, the platform and a digest of
# router/llmd-index's sources and go.mod/go.sum, so a change builds afresh and a second
# run with none is a no-op. Modules come from the Go module proxy, as go.sum pins them.
# Cold: ~1.5 min on 2 cores with the EPP's modules already in Go's caches.
#
# Usage:
#   hack/llmd-index.sh              build if missing; print the binary's path last
#   hack/llmd-index.sh --print-bin  print the path without building (exit 0 even when absent)
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
mod=$root/router/llmd-index
export GOTOOLCHAIN=local
export GOFLAGS="${GOFLAGS:-} -mod=readonly -buildvcs=false"

LOG_TAG=llmd-index
. "$root/hack/lib.sh"

command -v go >/dev/null 2>&1 || die "go is not installed (need Go >= 1.26 on PATH)"
go_version=$(go env GOVERSION)
platform=$(go env GOOS)-$(go env GOARCH)
llmd_version=$(cd "$mod" && go list -m -f '{{if .Replace}}{{.Replace.Version}}{{else}}{{.Version}}{{end}}' github.com/llm-d/llm-d-kv-cache)
src_digest=$(cd "$mod" && find . -type f \( -name '*.go' -o -name 'go.mod' -o -name 'go.sum' \) ! -name '*_test.go' -print0 |
  LC_ALL=C sort -z | xargs -0 cat | sha256sum | cut -c1-12)
key="llmd-kv-cache-${llmd_version}_${go_version}_${platform}_${src_digest}"
cache=${KVTIER_CACHE:-$HOME/.cache/kvtier}/llmd-index
dest=$cache/$key
bin=$dest/llmd-index

case "${1:-}" in
  --print-bin) echo "$bin"; exit 0 ;;
  "") ;;
  *) echo "usage: $0 [--print-bin]" >&2; exit 2 ;;
esac

complete() { [ -f "$dest/.complete" ] && [ -x "$bin" ]; }
cached_or_lock complete "$bin"

work=$(mktemp -d "$cache/.build-XXXXXX")
trap 'rm -rf "$work"' EXIT
started=$(date +%s)
log "building llmd-index (llm-d-kv-cache ${llmd_version}, Go ${go_version})"
(cd "$mod" && go build -v -trimpath -ldflags='-s -w' -o "$work/llmd-index" . 2>&1) | go_build_progress llmd-index 50
[ "${PIPESTATUS[0]}" -eq 0 ] || die "llmd-index build failed (see the go output above)"
rm -rf "$dest"
mkdir -p "$dest"
mv "$work/llmd-index" "$bin"
seconds=$(($(date +%s) - started))
printf 'llm-d-kv-cache=%s\ngo=%s\nbuild_seconds=%s\n' "$llmd_version" "$go_version" "$seconds" > "$dest/.complete"
log "built in ${seconds}s: $bin"
echo "$bin"
