#!/usr/bin/env bash
# Installs everything kvtier's demo and tests need, idempotently:
#   - Debian packages (redis-server, prometheus with promtool, prometheus-alertmanager,
#     valgrind for the benchmarks' instruction counts)
#     when missing,
#   - a local venv (.venv) with kvtier and its dev dependencies plus the test
#     environment (testenv/, its own project), re-installed only when either
#     pyproject.toml changes,
#   - the real Kubernetes control plane (kube-apiserver, kube-controller-manager,
#     etcd, kubectl, helm), built or unpacked once into a versioned cache outside git,
#   - Prometheus with Kubernetes service discovery (hack/prometheus.sh), likewise,
#   - what a real node needs (hack/nodes.sh): containerd, runc, CNI plugins, iptables,
#     buildah, mmdebstrap from Debian; kubelet, kube-proxy, kube-scheduler from the same
#     Kubernetes module; the pause image and a Debian base image, likewise cached,
#   - the project's image and the test-only reference engine's image, both built from
#     the Dockerfile (hack/image.sh), rebuilt when their sources change,
#   - CoreDNS, the test cluster's DNS, from its Go module (hack/coredns.sh), cached,
#   - vLLM's CPU build in its own venv, cached the same way (hack/vllm.sh),
#   - the Go modules of the router package (router/), in Go's module cache,
#   - kvtier's Endpoint Picker (router/epp) and the tests' ext_proc gateway stand-in,
#     built once per source digest into a cache (hack/epp.sh),
#   - llm-d's precise prefix-cache producer as the KV-event tests run it
#     (router/llmd-index), cached the same way (hack/llmd-index.sh).
# A second run is a no-op that takes a few seconds.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
export KVTIER_CACHE=${KVTIER_CACHE:-$HOME/.cache/kvtier}
mkdir -p "$KVTIER_CACHE"
log() { printf '[setup %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# --- Debian packages -------------------------------------------------------------
need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v prometheus >/dev/null 2>&1 || need_apt+=(prometheus)
command -v prometheus-alertmanager >/dev/null 2>&1 || need_apt+=(prometheus-alertmanager)
command -v valgrind >/dev/null 2>&1 || need_apt+=(valgrind)  # the benchmarks' instruction counts
if [ ${#need_apt[@]} -gt 0 ]; then
  log "installing Debian packages: ${need_apt[*]}"
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
# The Debian packages start a system redis (6379), Prometheus (9090) and Alertmanager
# (9093) where systemd runs; kvtier's tests and demo start their own on free ports.

# --- Python venv -------------------------------------------------------------------
py=${PYTHON:-python3}
stamp=.venv/.kvtier-installed
want=$(cat pyproject.toml setup.py testenv/pyproject.toml | sha256sum | cut -c1-16)
if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  "$py" -m venv .venv
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "installing kvtier and dependencies into .venv"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[dev]' -e ./testenv
  echo "$want" > "$stamp"
fi
# The core's hot modules, compiled by Cython beside their sources (setup.py): rebuilt
# whenever a source changed since, or the install above was a pure-Python one.
if [ -n "$(.venv/bin/python -W ignore -c 'import kvtier._compiled as c; print(*c.unbuilt_modules())')" ]; then
  log "compiling kvtier's hot modules (Cython)"
  .venv/bin/python setup.py -q build_ext --inplace --parallel 2 >/dev/null
fi

# --- vLLM (CPU build) for the connector's tests, in its own cached venv --------------
# Started now and awaited at the end: on a fresh machine its ~4 GB of wheels download
# while the Go builds below keep both cores busy. KVTIER_SKIP_VLLM=1 is for quick dev
# loops only: the vLLM tests fail without it.
vllm_pid=
if [ "${KVTIER_SKIP_VLLM:-0}" != 1 ]; then
  vllm_log=$(mktemp)
  bash hack/vllm.sh >"$vllm_log" 2>&1 &
  vllm_pid=$!
fi

# --- the Go router package (router/): its modules into Go's own caches, as the ------
# control plane's build uses them (GOMODCACHE, GOCACHE: Go's defaults), so the tests'
# `go test` runs offline. A no-op once downloaded.
command -v go >/dev/null 2>&1 || { log "ERROR: go is not installed (router/ needs Go >= 1.26 on PATH)"; exit 1; }
(cd router && GOTOOLCHAIN=local GOFLAGS=-mod=readonly go mod download && GOTOOLCHAIN=local go build ./...)
# The Endpoint Picker's upstream module: the chart tests read its runner's flags and its
# InferencePool CRD from the module's source.
(cd router/epp && GOTOOLCHAIN=local GOFLAGS=-mod=readonly go mod download sigs.k8s.io/gateway-api-inference-extension)
# kvtier-epp and extproc-gateway (tests/router runs the real EPP over ext_proc): ~9 min
# on a fresh machine at -p 1, seconds when only kvtier's packages changed, a no-op when
# cached (hack/epp.sh keys the cache by a digest of router/epp's and router/affinity's
# sources). KVTIER_SKIP_EPP=1 is for quick dev loops only: the EPP tests fail without it.
if [ "${KVTIER_SKIP_EPP:-0}" != 1 ]; then
  bash hack/epp.sh >/dev/null
fi
# llm-d's precise prefix-cache producer (router/llmd-index: tests/vllm/test_kv_events.py
# feeds it a real vLLM's KV events): ~1.5 min cold, a no-op when cached.
bash hack/llmd-index.sh >/dev/null

# --- checkov (chart lint), in its own venv -------------------------------------------
bash hack/checkov.sh

# --- Kubernetes control plane, kubectl, helm; Prometheus with Kubernetes discovery -----
if [ "${KVTIER_SKIP_CONTROLPLANE:-0}" != 1 ]; then
  bash hack/controlplane.sh
  bash hack/prometheus.sh
fi
# --- Real nodes (tests/nodes: kubelets + containerds running the chart's image) --------
# KVTIER_SKIP_NODES=1 is for quick dev loops only: the real-node tests fail without it.
if [ "${KVTIER_SKIP_NODES:-0}" != 1 ]; then
  bash hack/nodes.sh >/dev/null
  bash hack/image.sh >/dev/null
  bash hack/coredns.sh >/dev/null
fi

# --- the vLLM venv started above ----------------------------------------------------
if [ -n "$vllm_pid" ]; then
  if ! wait "$vllm_pid"; then
    cat "$vllm_log" >&2
    log "ERROR: hack/vllm.sh failed (its log is above)"
    exit 1
  fi
  grep -v '^/' "$vllm_log" >&2 || true  # its progress lines; the python path it prints last is not
  rm -f "$vllm_log"
fi
log "ready"
