"""vLLM's OpenAI server (the CPU build) as a serving pod's engine container on the real
nodes (`kvtier_testenv.nodes`), for the node tests and the vLLM demo.

The engine's command line names kvtier only as `--kv-transfer-config
$(KVTIER_KV_TRANSFER_CONFIG)`, the env the webhook renders from the policy. Its ~6 GB of
Python is the set-up's cached vLLM venv (hack/vllm.sh) mounted read-only from the host
with the interpreter it was built by, and this checkout's `kvtier_vllm` on its
PYTHONPATH: hostPath volumes, which PodSecurity allows only in a namespace at
`privileged`. A test-only arrangement: a serving image would carry vLLM and
`kvtier[vllm]` itself, and its pods would run under `restricted` as the reference
engine's do. vLLM's own prefix cache is off, so every cached prompt token it reports was
loaded from the sidecar.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from kvtier import names
from kvtier_testenv.vllm_engine import REPO, VLLM_BLOCK_SIZE, vllm_cache_seed, vllm_python

SRC = "/kvtier-src"
MODEL = "/model"
SERVED_MODEL = "tiny"
CACHE = "/vllm-home"
"""The engine's HOME and VLLM_CACHE_ROOT's parent: an emptyDir."""
POD_SECURITY = "privileged"
"""The namespace's PodSecurity level these pods need (their hostPath volumes)."""
READY_TIMEOUT_S = 900.0
"""vLLM's start in a pod on two busy cores: torch and vLLM imports from the mounted venv,
the model load, KV allocation."""


def host_library(soname: str) -> str:
    """The host's file of shared library `soname` (ldconfig's cache), links resolved."""
    out = subprocess.run(["ldconfig", "-p"], check=True, capture_output=True, text=True).stdout
    paths = [line.split("=>", 1)[1].strip() for line in out.splitlines()
             if line.strip().startswith(soname + " ") and "=>" in line]
    if not paths:
        raise FileNotFoundError(f"{soname} is not installed on this host (ldconfig -p)")
    return os.path.realpath(paths[0])


def engine_pod_spec(image: str, model: Path, port: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the engine container, the pod's volumes) serving the tiny Llama written at `model`
    on `port` of the pod's IP, from `image` (the project's: vLLM itself is mounted)."""
    python = Path(vllm_python())  # fails loudly when hack/vllm.sh has not built it
    venv = python.parent.parent
    interpreter = Path(os.path.realpath(python)).parent.parent  # what the venv's python links to
    mounts = {"venv": (str(venv), str(venv)), "interpreter": (str(interpreter), str(interpreter)),
              "src": (str(REPO), SRC), "model": (str(model), MODEL),
              # vLLM's model-info cache, so its start skips a subprocess (hack/vllm.sh)
              "modelinfos": (str(vllm_cache_seed() / "modelinfos"), f"{CACHE}/vllm/modelinfos")}
    # vLLM's CPU kernels link libnuma, which the project's base image lacks (a vLLM
    # serving image installs libnuma1): the host's, with the venv.
    numa = host_library("libnuma.so.1")
    block = str(VLLM_BLOCK_SIZE)
    engine = {
        "name": "engine", "image": image, "imagePullPolicy": "Never",
        "command": [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL,
                    "--served-model-name", SERVED_MODEL, "--host", f"$({names.POD_IP_ENV})", "--port", str(port),
                    "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager", "--block-size", block,
                    "--max-model-len", "4096", "--no-enable-prefix-caching", "--load-format", "safetensors",
                    "--enable-prompt-tokens-details", "--kv-transfer-config", "$(KVTIER_KV_TRANSFER_CONFIG)"],
        "env": [names.field_env(names.POD_IP_ENV, names.POD_IP_FIELD),
                {"name": "PYTHONPATH", "value": f"{SRC}:{SRC}/sidecar:{SRC}/connector"},
                {"name": "HOME", "value": CACHE}, {"name": "VLLM_CACHE_ROOT", "value": f"{CACHE}/vllm"},
                {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"}, {"name": "LD_LIBRARY_PATH", "value": "/opt/host-libs"}],
        # Root with the runtime's default capabilities, as the vllm/vllm-openai image runs:
        # the mounted venv is root's on the host, and root may open the sidecar's private
        # arena and socket (a non-root engine runs as the sidecar's user: docs/SECURITY.md).
        "securityContext": {"runAsUser": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False},
        "ports": [{"name": "http", "containerPort": port}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 2},
        "resources": {"requests": {"cpu": "100m", "memory": "1Gi"}, "limits": {"memory": "8Gi"}},
        "volumeMounts": [{"name": k, "mountPath": inside, "readOnly": True} for k, (_, inside) in mounts.items()]
                        + [{"name": "cache", "mountPath": CACHE},
                           {"name": "numa", "mountPath": "/opt/host-libs/libnuma.so.1", "readOnly": True}],
    }
    volumes = ([{"name": k, "hostPath": {"path": host, "type": "Directory"}} for k, (host, _) in mounts.items()]
               + [{"name": "cache", "emptyDir": {}}, {"name": "numa", "hostPath": {"path": numa, "type": "File"}}])
    return engine, volumes
