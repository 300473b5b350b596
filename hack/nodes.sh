#!/usr/bin/env bash
# Makes, once, what real Kubernetes nodes need on this machine besides the control plane
# (hack/controlplane.sh), and prints the two directories holding it:
#
#   containerd, runc, CNI plugins (bridge,    Debian packages, installed when missing
#   host-local, loopback), iptables,
#   conntrack, buildah, mmdebstrap
#   kubelet, kube-proxy, kube-scheduler       from the same k8s.io/kubernetes module and
#                                             staging replacements as the control plane
#                                             (the wrapper hack/k8s/kube)
#   <images>/pause.tar                         the pod sandbox image, compiled from the
#                                             module's build/pause/linux/pause.c
#   <images>/base.tar                          a Debian rootfs (mmdebstrap) with Python 3:
#                                             the base the Dockerfile's image is built on
#                                             (hack/image.sh), since no registry is reachable
#
# The binaries land in ${KVTIER_CACHE:-$HOME/.cache/kvtier}/nodes/bin-<key>, the images in
# .../nodes/images-<key>; each key names every version that went into it (Kubernetes, the
# Go toolchain, the platform and a digest of the wrapper module; the Debian suite, the
# base's packages and the image names), plus this script's NODES_REVISION, so a change to
# any of them builds afresh and a second run with none is a no-op (the packages are
# checked every run). Images are docker-archive tars tagged with the names pods use.
#
# Usage:
#   hack/nodes.sh                     build what is missing; print both dirs last
#   hack/nodes.sh --print-bin-dir     print the binaries' dir without building (exit 0 even
#                                     when it is not built yet); --print-images-dir likewise
set -euo pipefail

KUBE_VERSION=v1.33.13
# Bumped whenever what this script makes changes in a way the other parts of the key miss.
NODES_REVISION=1
DEBIAN_SUITE=bookworm
DEBIAN_MIRROR=http://deb.debian.org/debian
# Python 3 (bookworm: 3.11) and venv for the image; no compiler (the Dockerfile's build
# stage installs its own).
BASE_PACKAGES=python3,python3-venv,ca-certificates
BASE_IMAGE=localhost/kvtier-base:${DEBIAN_SUITE}
# The sandbox image kubelet v1.33 names by default; containerd's sandbox_image and kubelet's
# --pod-infra-container-image are set to it as well.
PAUSE_IMAGE=registry.k8s.io/pause:3.10
APT_PACKAGES=(containerd runc containernetworking-plugins iptables conntrack buildah mmdebstrap)
BINARIES=(kubelet kube-proxy kube-scheduler)

root=$(cd "$(dirname "$0")/.." && pwd)
export GOTOOLCHAIN=local
export GOFLAGS="${GOFLAGS:-} -mod=readonly"

log() { printf '[nodes %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

command -v go >/dev/null 2>&1 || die "go is not installed (need Go >= 1.24 on PATH)"
go_version=$(go env GOVERSION)
platform=$(go env GOOS)-$(go env GOARCH)
wrapper_digest=$(cat "$root"/hack/k8s/kube/go.mod "$root"/hack/k8s/kube/go.sum | sha256sum | cut -c1-12)
images_digest=$(printf '%s %s %s %s' "$DEBIAN_SUITE" "$BASE_PACKAGES" "$BASE_IMAGE" "$PAUSE_IMAGE" | sha256sum | cut -c1-12)
cache=${KVTIER_CACHE:-$HOME/.cache/kvtier}/nodes
bin=$cache/bin-k8s-${KUBE_VERSION}_${go_version}_${platform}_${wrapper_digest}_r${NODES_REVISION}
images=$cache/images-${DEBIAN_SUITE}_${platform}_${images_digest}_r${NODES_REVISION}

bin_complete() {
  [ -f "$bin/.complete" ] || return 1
  local b
  for b in "${BINARIES[@]}"; do [ -x "$bin/$b" ] || return 1; done
}
images_complete() {
  [ -f "$images/.complete" ] && [ -s "$images/pause.tar" ] && [ -s "$images/base.tar" ]
}

case "${1:-}" in
  "") ;;
  --print-bin-dir) echo "$bin"; exit 0 ;;
  --print-images-dir) echo "$images"; exit 0 ;;
  *) echo "usage: $0 [--print-bin-dir|--print-images-dir]" >&2; exit 2 ;;
esac

# --- Debian packages (checked every run: a fresh machine has the cache but not them) ----
need_apt=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need_apt+=("$p")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  log "installing Debian packages: ${need_apt[*]}"
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi
for f in /usr/lib/cni/bridge /usr/lib/cni/host-local /usr/lib/cni/loopback; do
  [ -x "$f" ] || die "$f missing after installing containernetworking-plugins"
done

mkdir -p "$cache"
# One build at a time per cache; a second caller waits and then finds it complete.
exec 9>"$cache/.lock"
flock 9
work=$(mktemp -d "$cache/.build-XXXXXX")
containers=()
cleanup() {
  local c
  for c in "${containers[@]}"; do buildah rm "$c" >/dev/null 2>&1 || true; done
  rm -rf "$work"
}
trap cleanup EXIT

build_binaries() {
  local started minor ldflags p b
  started=$(date +%s)
  mkdir -p "$work/bin"
  # Same ldflags as the control plane: /version and the Node's kubeletVersion report the
  # real release.
  minor=${KUBE_VERSION#v1.}; minor=${minor%%.*}
  ldflags="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $p.gitVersion=${KUBE_VERSION} -X $p.gitMajor=1 -X $p.gitMinor=${minor}"
    ldflags+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
  done
  log "building ${BINARIES[*]} ${KUBE_VERSION} (Go ${go_version}; most packages are shared with the control plane's build)"
  (cd "$root/hack/k8s/kube" &&
    go build -trimpath -ldflags="$ldflags" -o "$work/bin/" \
      k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy k8s.io/kubernetes/cmd/kube-scheduler) ||
    die "kubelet/kube-proxy/kube-scheduler build failed (see the go output above)"
  for b in "${BINARIES[@]}"; do "$work/bin/$b" --version >/dev/null || die "built $b does not run"; done
  echo "kubernetes=${KUBE_VERSION} go=${go_version} build_seconds=$(($(date +%s) - started))" > "$work/bin/.complete"
  rm -rf "$bin"
  mv "$work/bin" "$bin"
  log "built in $(($(date +%s) - started))s: $bin"
}

# An image from a directory tree: a container from scratch, the tree copied in, configured
# by the remaining arguments (buildah config flags), committed and saved as a
# docker-archive tagged $1 (which ctr imports under that name).
image_from_tree() {
  local name=$1 tree=$2 out=$3 c
  shift 3
  c=$(buildah from scratch); containers+=("$c")
  buildah add "$c" "$tree" / >/dev/null
  buildah config "$@" "$c"
  buildah commit -q --rm "$c" "$name" >/dev/null
  rm -f "$out"
  buildah push -q "$name" "docker-archive:$out:$name" >/dev/null
}

build_images() {
  local started kube_src pause_c
  started=$(date +%s)
  mkdir -p "$work/images" "$work/pause"
  # --- the pause image
  kube_src=$(cd "$root/hack/k8s/kube" && go mod download -json k8s.io/kubernetes |
    sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
  pause_c=$kube_src/build/pause/linux/pause.c
  [ -f "$pause_c" ] || die "$pause_c not found in the k8s.io/kubernetes module"
  command -v gcc >/dev/null 2>&1 || die "gcc is not installed (needed to compile the pause binary)"
  gcc -Os -static -Wall -Werror -DVERSION="\"${PAUSE_IMAGE##*:}-kvtier\"" -o "$work/pause/pause" "$pause_c" ||
    die "compiling $pause_c failed"
  strip "$work/pause/pause"
  log "making the pause image ${PAUSE_IMAGE}"
  image_from_tree "$PAUSE_IMAGE" "$work/pause" "$work/images/pause.tar" \
    --entrypoint '["/pause"]' --user 65535:65535
  buildah rmi "$PAUSE_IMAGE" >/dev/null 2>&1 || true
  # --- the Debian base image
  log "making the base image ${BASE_IMAGE} (mmdebstrap ${DEBIAN_SUITE}: ${BASE_PACKAGES})"
  mmdebstrap --quiet --variant=minbase --include="$BASE_PACKAGES" \
    --aptopt='APT::Install-Recommends "false"' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
    "$DEBIAN_SUITE" "$work/rootfs.tar" "$DEBIAN_MIRROR" || die "mmdebstrap failed"
  # BASE_IMAGE stays in buildah's storage for hack/image.sh (which loads base.tar again
  # into a storage that lacks it).
  image_from_tree "$BASE_IMAGE" "$work/rootfs.tar" "$work/images/base.tar" \
    --cmd '["/bin/bash"]' --env LANG=C.UTF-8 \
    --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
  rm -f "$work/rootfs.tar"
  {
    echo "pause_image=${PAUSE_IMAGE}"
    echo "base_image=${BASE_IMAGE}"
    echo "debian=${DEBIAN_SUITE} ${BASE_PACKAGES}"
    echo "build_seconds=$(($(date +%s) - started))"
  } > "$work/images/.complete"
  rm -rf "$images"
  mv "$work/images" "$images"
  log "made in $(($(date +%s) - started))s: $images"
}

if [ "${KVTIER_NODES_SKIP_BINARIES:-0}" != 1 ]; then
  if bin_complete; then log "cached: $bin"; else build_binaries; fi
fi
if images_complete; then log "cached: $images"; else build_images; fi
echo "$bin"
echo "$images"
