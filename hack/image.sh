#!/usr/bin/env bash
# Builds the project's image from the Dockerfile (the one recipe of the image users pull)
# with buildah, on the local Debian base hack/nodes.sh makes (no registry is reachable
# here), and saves it as a docker-archive tagged with the name and tag the chart runs by
# default (image.repository in charts/kvtier/values.yaml : the chart's appVersion), which
# the test clusters import into containerd. Prints the archive's path.
#
# Beside it, the same Dockerfile's `reference-engine` target (a test-only image: the
# reference engine's HTTP front over the sidecar client, tagged ENGINE_REPOSITORY:tag),
# saved to its own archive whose stamp adds the testenv/ files it copies to the
# project image's.
#
# The archive is cached under ${KVTIER_CACHE:-$HOME/.cache/kvtier}/image/, named by a
# content stamp of the build context (every file the Dockerfile can copy, after
# .dockerignore), the Dockerfile, .dockerignore and the base image: any change to the
# sources rebuilds it; none is a no-op. The newest KEEP archives are kept.
#
# Usage:
#   hack/image.sh                build when the stamp changed; print the archive's path
#   hack/image.sh --print-path   print the path for the current sources without building
#   hack/image.sh --print-engine-path   the same for the reference engine's archive
set -euo pipefail
KEEP=4
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
log() { printf '[image %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

repository=$(sed -n 's/^  repository: *//p' charts/kvtier/values.yaml | head -n1)
tag=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' charts/kvtier/Chart.yaml)
[ -n "$repository" ] && [ -n "$tag" ] || die "cannot read image.repository / appVersion from charts/kvtier"
name=$repository:$tag
ENGINE_REPOSITORY=localhost/kvtier-reference-engine
engine_name=$ENGINE_REPOSITORY:$tag
images=$(bash hack/nodes.sh --print-images-dir)
base_image=$(sed -n 's/^base_image=//p' "$images/.complete" 2>/dev/null || true)

# The build context as buildah sees it: the files the Dockerfile copies, without what
# .dockerignore leaves out (git's view of untracked-but-not-ignored files included).
stamp=$( {
  sha256sum Dockerfile .dockerignore
  git ls-files -z -co --exclude-standard -- pyproject.toml setup.py README.md kvtier sidecar operator apps |
    grep -zv -e '__pycache__/' -e '\.pyc$' -e '\.so$' -e '\.egg-info/' -e '^kvtier/_compiled\.json$' |
    sort -z | xargs -0 sha256sum
  sha256sum "$images/base.tar" 2>/dev/null | cut -c1-64 || true
} | sha256sum | cut -c1-16)
# The engine's stamp adds the testenv/ files the Dockerfile's COPY lines name.
engine_stamp=$( {
  echo "$stamp"
  grep -o 'testenv/[A-Za-z0-9_./-]*\.\(py\|toml\)' Dockerfile | sort -u | xargs sha256sum
} | sha256sum | cut -c1-16)
cache=${KVTIER_CACHE:-$HOME/.cache/kvtier}/image
out=$cache/kvtier-$tag-$stamp.tar
engine_out=$cache/reference-engine-$tag-$engine_stamp.tar

if [ "${1:-}" = "--print-path" ]; then echo "$out"; exit 0; fi
if [ "${1:-}" = "--print-engine-path" ]; then echo "$engine_out"; exit 0; fi
[ $# -eq 0 ] || { echo "usage: $0 [--print-path|--print-engine-path]" >&2; exit 2; }

if [ -s "$out" ] && [ -s "$engine_out" ]; then
  touch "$out" "$engine_out"
  log "cached: $out ($name), $engine_out ($engine_name)"
  echo "$out"
  exit 0
fi
[ -n "$base_image" ] && [ -s "$images/base.tar" ] || die "the base image is missing: run hack/nodes.sh first"
command -v buildah >/dev/null 2>&1 || die "buildah is not installed (hack/nodes.sh installs it)"
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9
if [ -s "$out" ] && [ -s "$engine_out" ]; then echo "$out"; exit 0; fi
if ! buildah inspect --type image "$base_image" >/dev/null 2>&1; then
  log "loading the base image $base_image into buildah's storage"
  buildah pull -q "docker-archive:$images/base.tar" >/dev/null
fi

# The build runs with the host's network and, for its downloads (Debian packages for the
# build stage, the wheels from PyPI), the host's CA bundle and pip configuration: a
# machine behind a TLS-inspecting proxy trusts what the host trusts. They are mounted for
# the RUN steps only and never enter the image.
mounts=()
[ -f /etc/ssl/certs/ca-certificates.crt ] &&
  mounts+=(--volume /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
[ -f /etc/pip.conf ] && mounts+=(--volume /etc/pip.conf:/etc/pip.conf:ro)
started=$(date +%s)
tmp=$(mktemp "$cache/.kvtier-XXXXXX.tar")
trap 'rm -f "$tmp"' EXIT
# build TARGET NAME ARCHIVE: one target of the Dockerfile (the layers the two share are
# built once), saved as a docker-archive tagged NAME.
build() {
  log "building $2 from the Dockerfile${1:+ (target $1)} on $base_image"
  buildah build --quiet --layers --isolation chroot --network host --pull-never \
    --build-arg "BASE_IMAGE=$base_image" "${mounts[@]}" ${1:+--target "$1"} \
    --tag "$2" --file Dockerfile . >/dev/null || die "buildah build of $2 failed (see above)"
  rm -f "$tmp"
  buildah push -q "$2" "docker-archive:$tmp:$2" >/dev/null
  mv "$tmp" "$3"
}
[ -s "$out" ] || build "" "$name" "$out"
[ -s "$engine_out" ] || build reference-engine "$engine_name" "$engine_out"
# Older stamps: the newest KEEP of each stay (other checkouts may be on them).
ls -1t "$cache"/kvtier-*.tar 2>/dev/null | tail -n +$((KEEP + 1)) | xargs -r rm -f
ls -1t "$cache"/reference-engine-*.tar 2>/dev/null | tail -n +$((KEEP + 1)) | xargs -r rm -f
buildah images --filter dangling=true -q | xargs -r buildah rmi >/dev/null 2>&1 || true
log "built in $(($(date +%s) - started))s: $out ($name), $engine_out ($engine_name)"
echo "$out"
