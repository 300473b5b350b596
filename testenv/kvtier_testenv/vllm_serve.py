"""`vllm serve` (vLLM's OpenAI server, the venv's `vllm` command as a user types it)
for tests and benchmarks, spoken to over HTTP, with a peer fleet around it:

    srv = VllmServer(workdir, model_dir, connector_config(sock, "sha256:..")).start()
    srv.complete(prompt, "tenant-a")  -> {"tokens", "cached", "ttft_s", "seconds"}
    srv.stream(prompt, "tenant-a", out) (out["times"], out["tokens"], token by token)
    srv.metrics(), srv.reset_prefix_cache(), srv.close()

    peer_sidecar(workdir, name, ip, shape, weights, redis_url, secret_file, **config)
                                      a loopback sidecar of a peer fleet (Redis index)

vLLM's own prefix cache is on (its default) unless `prefix_caching=False`;
`reset_prefix_cache` (VLLM_SERVER_DEV_MODE) empties it so the next ask goes to kvtier.
"""
from __future__ import annotations

import http.client
import json
import re
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvtier import control_api

from . import processes
from .control_client import NoDelayHTTPConnection
from .fleet import SidecarHandle, fleet_tls
from .polling import wait_for
from .vllm_engine import KV_CACHE_SPACE_GIB, START_TIMEOUT_S, VLLM_BLOCK_SIZE, sidecar_model, vllm_env, vllm_python

REQUEST_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class VllmServer:
    workdir: Path
    model: Path
    connector: dict | None = None
    name: str = "serve"
    prefix_caching: bool = True
    port: int = 0
    proc: subprocess.Popen | None = None
    extra_args: list[str] = field(default_factory=list)

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def start(self) -> "VllmServer":
        self.port = self.port or free_port()
        argv = [str(Path(vllm_python()).parent / "vllm"), "serve", str(self.model), "--served-model-name", "tiny",
                "--host", "127.0.0.1", "--port", str(self.port), "--skip-tokenizer-init", "--dtype", "float32",
                "--enforce-eager", "--block-size", str(VLLM_BLOCK_SIZE), "--max-model-len", "4096",
                "--load-format", "safetensors", "--enable-prompt-tokens-details", *self.extra_args]
        if not self.prefix_caching:
            argv.append("--no-enable-prefix-caching")
        if self.connector is not None:
            argv += ["--kv-transfer-config", json.dumps(self.connector)]
        env = vllm_env(VLLM_CPU_KVCACHE_SPACE=KV_CACHE_SPACE_GIB, VLLM_CACHE_ROOT=str(self.workdir / f"{self.name}-cache"),
                       VLLM_SERVER_DEV_MODE="1")  # /reset_prefix_cache
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
                                     start_new_session=True)
        log.close()
        try:
            wait_for(f"vllm serve {self.name} healthy", lambda: self.proc.poll() is not None or self._ready(),
                     START_TIMEOUT_S, 1.0)
        except BaseException:
            self.close()
            raise
        if self.proc.poll() is not None:
            raise RuntimeError(f"vllm serve {self.name} exited {self.proc.returncode}:\n{self.log()[-4000:]}")
        return self

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def _post(self, body: dict) -> http.client.HTTPResponse:
        conn = NoDelayHTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"vllm serve {self.name}: HTTP {resp.status}: {resp.read()[:500]!r}")
        return resp

    def complete(self, prompt: list[int], salt: str, max_tokens: int = 8) -> dict:
        """A streamed greedy completion: its token ids, the prompt tokens vLLM reports
        cached (its own prefix cache and kvtier's), the time to the first token and to
        the last, measured at this client from sending the request."""
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "cache_salt": salt, "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}}
        started = time.perf_counter()
        resp = self._post(body)
        tokens: list[int] = []
        ttft, cached = None, 0
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                ids = choice.get("token_ids") or []
                if ids and ttft is None:
                    ttft = time.perf_counter() - started
                tokens.extend(ids)
            usage = chunk.get("usage") or {}
            cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or cached)
        return {"tokens": tokens, "cached": cached, "ttft_s": ttft, "seconds": time.perf_counter() - started}

    def stream(self, prompt: list[int], salt: str, max_tokens: int, out: dict) -> None:
        """A streamed completion that runs to max_tokens: out["times"] gets each
        token's arrival (monotonic), out["tokens"] the ids, as they come."""
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "cache_salt": salt, "stream": True, "return_token_ids": True, "ignore_eos": True}
        read_token_stream(self._post(body), out)

    def metrics(self) -> dict[str, float]:
        return vllm_metrics(self.port)

    def reset_prefix_cache(self) -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            if json.loads(r.read()).get("success") is not True:
                raise RuntimeError(f"vllm serve {self.name}: /reset_prefix_cache did not succeed")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        processes.stop_group(self.proc, 60)


def read_token_stream(lines, out: dict) -> None:
    """A streamed completion's server-sent events into out["times"] (each token's
    arrival, monotonic) and out["tokens"] (the ids), as they come."""
    out["times"], out["tokens"] = [], []
    for raw in lines:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        ids = json.loads(line[5:])["choices"][0].get("token_ids") or []
        if ids:
            out["times"].extend([time.monotonic()] * len(ids))
            out["tokens"].extend(ids)


def vllm_metrics(port: int) -> dict[str, float]:
    """A `vllm serve` server's /metrics, each family summed over its label sets."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})? (\S+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def peer_sidecar(workdir: Path, name: str, ip: str, shape, weights: str, redis_url: str, secret_file: str,
                 **overrides) -> SidecarHandle:
    """A loopback sidecar of the peer fleet for `shape` (tiny Llama, fp32 KV, block 32)."""
    cfg = {"pod_name": name, "pod_namespace": "kvtier-serve-peer", "pod_ip": ip, "http_port": 0, "peer_port": 0,
           "engine_socket": str(workdir / f"{name}.sock"), "model": sidecar_model(shape, weights),
           "block_size": VLLM_BLOCK_SIZE, "dram_capacity_bytes": 64 << 20, "min_sightings": 1,
           "redis_url": redis_url, "peer_secret_file": secret_file, "log_level": "WARNING",
           # no API server on loopback to review tokens: the control API is open
           "control_auth": {"mode": "open"}, "control_tls": fleet_tls(workdir).config(), **overrides}
    return SidecarHandle(name, ip, workdir, cfg).start()


def sidecar_metric(sidecar: SidecarHandle, name: str, **labels) -> float:
    """A sidecar /metrics family summed over the series with `labels`."""
    status, body = sidecar.get(control_api.METRICS.path)
    if status != 200:
        raise RuntimeError(f"sidecar {sidecar.name}: /metrics answered {status}")
    total = 0.0
    for line in body.decode().splitlines():
        m = re.match(rf"^{name}(?:{{([^}}]*)}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total
