"""`vllm serve` (the OpenAI server) as the serving container of an injected pod: its
command line and environment are what the webhook gives it, its sidecar's config is
what the operator renders from the same policy, and a router's `cache_salt` picks the
tenant. No cluster: the pod's shared volume is a directory both processes use."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from kvtier import policy
from kvtier.sidecar_config import ControlAuthConfig, ServedModel
from kvtier_operator import injection, names, sidecar_render
from kvtier_operator import rollout_warmup as rw, rollout_warmup_io as rwio
from kvtier_operator.membership import Member, MemberName
from kvtier_operator.sidecar_client import ControlTls, SidecarClient as ControlClient
from kvtier_sidecar.client import SidecarClient
from kvtier_testenv import engine_io, processes
from kvtier_operator.engine_env import KV_TRANSFER_CONFIG_ENV
from kvtier_testenv.fleet import SidecarHandle, fleet_namespace, fleet_tls
from kvtier_testenv.synthetic import prefill_kv
from kvtier_testenv.polling import wait_for
from kvtier_testenv.tiny_llama import TinyLlama, write_model
from kvtier_testenv.vllm_serve import read_token_stream, vllm_metrics
from kvtier_testenv.vllm_engine import (
    KV_CACHE_SPACE_GIB, START_TIMEOUT_S, connector_config, sidecar_model, vllm_env, vllm_python,
)

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
    sidecar = SidecarHandle("sidecar", "127.0.0.2", tmp_path,
                            {**cfg.model_dump(mode="json"), "control_tls": fleet_tls(tmp_path).config()}).start()

    model = write_model(tmp_path / "model", seed=0)
    port = _free_port()
    pod = {"metadata": {"name": POD, "namespace": NAMESPACE, "labels": {"app": "tiny"}},
           "spec": {"containers": [{"name": "engine", "image": "vllm/vllm-openai"}]}}
    engine = {c["name"]: c for c in injection.inject(pod, "tiny", spec, injection.SidecarImage(image="k"))
              ["spec"]["containers"]}["engine"]
    env = _kubelet_env(engine)
    env["XDG_RUNTIME_DIR"] = str(run_dir)  # the volume's mount path, as the node maps it here
    # The webhook's config, except the lookup budget: on a loaded 2-core machine a lookup
    # can take longer than the default 200 ms, and then vLLM rightly prefills without it
    # (a miss, which this test would misread). What a budget does is the hung-sidecar
    # test's business; this one checks which blocks each tenant is served.
    ktc = json.loads(env[KV_TRANSFER_CONFIG_ENV])
    ktc["kv_connector_extra_config"]["lookup_budget_ms"] = 30_000
    env[KV_TRANSFER_CONFIG_ENV] = json.dumps(ktc)
    # `vllm serve MODEL`, as the container's command is
    argv = [str(Path(vllm_python()).parent / "vllm"), "serve", str(model), "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(port),
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
        processes.stop_group(proc, 60)
        log.close()
        sidecar.kill()
        shutil.rmtree(run_dir, ignore_errors=True)


# ------------------------------------------------------------------------------------
# `vllm serve` as a user types it (the venv's `vllm` command), vLLM's own prefix cache
# on (its default), one sidecar that is then hung with SIGSTOP.
# ------------------------------------------------------------------------------------

BUDGET_MS = 1000.0
"""The connector's lookup budget in these tests: a healthy lookup on two busy cores
must not miss it, a hung sidecar's 8 x 10 s would be far past it."""
SOCKET_TIMEOUT_S = 10.0
"""What a lookup waited for a hung sidecar before the budget (its socket timeout): far
above the hung round's bound below, so that even one request made to wait it fails."""
BACKOFF_S = 10.0
"""Longer than a round: the round after the trip runs with the breaker open throughout."""
CONCURRENT = 8
STREAM_TOKENS = 48
SERVE_WEIGHTS = "sha256:" + "d4" * 32


@dataclass
class Served:
    port: int
    sidecar: SidecarHandle
    log_path: Path
    rng: random.Random

    def prompt(self, n: int = 200) -> list[int]:
        return [self.rng.randrange(3, SHAPE.vocab) for _ in range(n)]

    def metrics(self) -> dict[str, float]:
        return vllm_metrics(self.port)

    def log(self) -> str:
        return self.log_path.read_text()

    def reset_prefix_cache(self) -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["success"] is True


def _sidecar_metric(sidecar: SidecarHandle, name: str, **labels) -> float:
    status, body = sidecar.get("/metrics")
    assert status == 200
    total = 0.0
    for line in body.decode().splitlines():
        m = re.match(rf"^{name}{{([^}}]*)}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("serve")
    socket_path = str(workdir / "engine.sock")
    sidecar = SidecarHandle("serve-sc", "127.0.0.2", workdir, {
        "pod_name": "serve-sc", "pod_namespace": "kvtier-serve", "pod_ip": "127.0.0.2", "http_port": 0,
        "peer_port": 0, "peer_enabled": False, "engine_socket": socket_path,
        "model": sidecar_model(SHAPE, SERVE_WEIGHTS), "block_size": 32, "dram_capacity_bytes": 64 << 20,
        "min_sightings": 1, "log_level": "WARNING", "control_auth": {"mode": "open"},
        "control_tls": fleet_tls(workdir).config()}).start()
    model = write_model(workdir / "model", seed=0)
    port = _free_port()
    ktc = connector_config(socket_path, SERVE_WEIGHTS, model_id="tiny-llama", block_size=32,
                           lookup_budget_ms=BUDGET_MS, lookup_timeout_s=SOCKET_TIMEOUT_S,
                           breaker_backoff_s=BACKOFF_S)
    vllm_cmd = str(Path(vllm_python()).parent / "vllm")
    argv = [vllm_cmd, "serve", str(model), "--served-model-name", "tiny", "--host", "127.0.0.1",
            "--port", str(port), "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager",
            "--block-size", "32", "--max-model-len", "4096", "--load-format", "safetensors",
            "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(ktc)]
    env = vllm_env(VLLM_CPU_KVCACHE_SPACE=KV_CACHE_SPACE_GIB, VLLM_CACHE_ROOT=str(workdir / "vllm-cache"),
                   VLLM_SERVER_DEV_MODE="1")  # /reset_prefix_cache
    log_path = workdir / "vllm-serve.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
                            start_new_session=True)
    try:
        wait_for("vllm serve healthy", lambda: proc.poll() is not None or _ready(port), START_TIMEOUT_S, 1.0)
        assert proc.poll() is None, log_path.read_text()[-4000:]
        yield Served(port, sidecar, log_path, random.Random(27))
    finally:
        sidecar.proc.send_signal(signal.SIGCONT)
        processes.stop_group(proc, 60)
        log.close()
        sidecar.kill()


def test_vllm_serve_with_its_prefix_cache_on_loads_from_kvtier_only_what_its_own_cache_lacks(served):
    prompt = served.prompt()
    first = _complete(served.port, prompt, "tenant-a")
    assert first["cached"] == 0
    wait_for("the prompt stored", lambda: served.sidecar.stats("tenant-a")["cache"]["stored_blocks"] >= 6, 60)
    before = served.metrics()
    local = _complete(served.port, prompt, "tenant-a")   # vLLM's own cache holds it
    assert local == {"tokens": first["tokens"], "cached": 192}
    after = served.metrics()
    assert after["vllm:kvtier_loaded_tokens_dram_total"] == before.get("vllm:kvtier_loaded_tokens_dram_total", 0)
    assert after["vllm:kvtier_local_hit_tokens_total"] - before.get("vllm:kvtier_local_hit_tokens_total", 0) == 192

    served.reset_prefix_cache()                          # now only kvtier holds it
    loaded = _complete(served.port, prompt, "tenant-a")
    assert loaded == {"tokens": first["tokens"], "cached": 192}
    got = served.metrics()
    loaded_tokens = got["vllm:kvtier_loaded_tokens_dram_total"] - after["vllm:kvtier_loaded_tokens_dram_total"]
    assert loaded_tokens == 192
    # one hit figure: the connector's, vLLM's own and the sidecar's agree
    assert got["vllm:external_prefix_cache_hits_total"] - after.get("vllm:external_prefix_cache_hits_total", 0) \
        == loaded_tokens
    wait_for("the sidecar told what the engine loaded",
             lambda: _sidecar_metric(served.sidecar, "kvtier_engine_loaded_tokens_total", tier="dram") == 192, 30)


def _stream(port: int, prompt: list[int], salt: str, out: dict) -> None:
    """A streamed completion; out["times"] gets each token's arrival, out["tokens"] the ids."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": STREAM_TOKENS, "temperature": 0.0,
            "cache_salt": salt, "stream": True, "return_token_ids": True, "ignore_eos": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        read_token_stream(r, out)


def _round(served: Served, salt: str, hang: bool = False) -> dict:
    """A stream decoding, then CONCURRENT new requests at once (the sidecar SIGSTOPped
    first when `hang`): how long the requests took, the stream's largest gap between
    tokens while they ran and within the first `BUDGET_MS` (while a hung sidecar's
    lookups are still waited for), and every answer."""
    stream_prompt, prompts = served.prompt(), [served.prompt() for _ in range(CONCURRENT)]
    stream: dict = {}
    streamer = threading.Thread(target=_stream, args=(served.port, stream_prompt, salt, stream))
    streamer.start()
    wait_for("the stream decoding", lambda: len(stream.get("times", ())) >= 4, 120, 0.01)
    if hang:
        served.sidecar.proc.send_signal(signal.SIGSTOP)
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
        answers = list(pool.map(lambda p: _complete(served.port, p, salt)["tokens"], prompts))
    ended = time.monotonic()
    streamer.join(300)
    last = stream["times"][-1]  # the stream may end before the round does
    return {"seconds": ended - started, "max_gap_s": _max_gap(stream["times"], started, min(ended, last)),
            "waiting_gap_s": _max_gap(stream["times"], started, min(started + BUDGET_MS / 1000, last)),
            "answers": answers, "prompts": prompts, "stream": stream["tokens"], "stream_prompt": stream_prompt}


def _max_gap(times: list[float], start: float, end: float) -> float:
    """The longest stretch of [start, end] without a token (0 for an empty stretch)."""
    inside = [t for t in times if start <= t <= end]
    return max((b - a for a, b in zip([start] + inside, inside + [end])), default=0.0)


def test_a_hung_sidecar_costs_requests_a_miss_within_the_budget_never_the_engine(served):
    budget_s = BUDGET_MS / 1000
    _round(served, "warm-up")  # first-use costs out of the way
    healthy = _round(served, "healthy")
    trips = served.metrics().get("vllm:kvtier_breaker_trips_total", 0)
    try:
        hung = _round(served, "hung", hang=True)
        # Still hung, the breaker open: the same burst as vLLM serves it without kvtier
        # (every lookup skipped, all eight prefilled together, as in the hung round
        # once its budget has passed): the baseline for the time after the budget.
        skipped = served.metrics().get("vllm:kvtier_lookups_skipped_total", 0)
        bypassed = _round(served, "bypassed")
        assert served.metrics()["vllm:kvtier_lookups_skipped_total"] - skipped >= CONCURRENT, \
            "the breaker closed before the baseline round ended"
    finally:
        served.sidecar.proc.send_signal(signal.SIGCONT)
    print(f"\n{CONCURRENT} requests: healthy {healthy['seconds']:.3f} s, hung {hung['seconds']:.3f} s, without "
          f"kvtier {bypassed['seconds']:.3f} s; stream's largest gap: healthy {healthy['max_gap_s']:.3f} s, hung "
          f"{hung['max_gap_s']:.3f} s (while waiting {hung['waiting_gap_s']:.3f} s), without kvtier "
          f"{bypassed['max_gap_s']:.3f} s; budget {budget_s} s")
    slowest = max(healthy["seconds"], bypassed["seconds"])
    assert 2 * slowest + budget_s < SOCKET_TIMEOUT_S, "the machine is too slow for this test to tell"
    # Without the budget each new request waited a socket timeout behind the last
    # (8 x 10 s); budgets taken one after another would be 8 x 1 s.
    assert hung["seconds"] <= 2 * slowest + budget_s, (hung["seconds"], healthy["seconds"], bypassed["seconds"])
    # While the requests wait for their lookups the stream goes on decoding: a scheduler
    # step that waited for the sidecar would leave no token for the whole budget.
    assert hung["waiting_gap_s"] <= budget_s / 2, hung["waiting_gap_s"]
    # After it the eight are prefilled together, as vLLM does without kvtier: no stall
    # longer than twice the baseline rounds' largest gap, or than the half budget the
    # waiting is held to (gaps of ~0.1 s move by as much on two busy cores).
    assert hung["max_gap_s"] <= max(2 * max(healthy["max_gap_s"], bypassed["max_gap_s"]), budget_s / 2), \
        (hung["max_gap_s"], healthy["max_gap_s"], bypassed["max_gap_s"])
    assert served.metrics()["vllm:kvtier_breaker_trips_total"] > trips
    assert "not asking the sidecar" in served.log()

    # the sidecar answers again: a probe closes the breaker and kvtier serves again
    def recovered() -> bool:
        _complete(served.port, served.prompt(), "probe")
        return served.metrics().get("vllm:kvtier_breaker_recoveries_total", 0) >= 1
    wait_for("the breaker closed", recovered, 60, 0.2)
    assert "answers again" in served.log()

    # every answer equals the same prompt recomputed under a tenant of its own
    baseline = [_complete(served.port, p, "baseline")["tokens"] for p in hung["prompts"]]
    assert hung["answers"] == baseline
    again = _complete(served.port, hung["stream_prompt"], "baseline-stream")
    assert hung["stream"][: len(again["tokens"])] == again["tokens"]
    # and a stored prompt is served from kvtier after the recovery
    served.reset_prefix_cache()
    reloaded = _complete(served.port, healthy["prompts"][0], "healthy")
    assert reloaded == {"tokens": healthy["answers"][0], "cached": 192}


OLD_WEIGHTS = "sha256:" + "b2" * 32


def test_a_new_version_pod_warmed_through_vllms_http_api_serves_its_tenants_prefixes_from_kvtier(served, tmp_path):
    """Warm-before-ready (#24) against the real engine: the operator's own warm-up steps
    (the old version's sidecar's `GET /cache/hot`, ranked and planned within the budget,
    replayed by `rollout_warmup_io._prefill` as max_tokens=1 completions with the
    tenant's cache_salt) prefill the new version's vLLM; its first request for a warmed
    prefix is a kvtier hit, with the tokens a recompute gives."""
    tenant, block = "warm-t", 32
    old_model = sidecar_model(SHAPE, OLD_WEIGHTS)
    old_identity = ServedModel(**old_model)
    block_bytes = old_identity.kv_bytes_per_token() * block
    old = SidecarHandle("old-sc", "127.0.0.3", tmp_path, {
        "pod_name": "old-sc", "pod_namespace": "kvtier-serve", "pod_ip": "127.0.0.3", "http_port": 0,
        "peer_port": 0, "peer_enabled": False, "engine_socket": str(tmp_path / "old.sock"),
        "model": old_model, "block_size": block, "dram_capacity_bytes": 64 << 20, "min_sightings": 1,
        "log_level": "WARNING", "control_auth": {"mode": "open"},
        "control_tls": fleet_tls(tmp_path).config()}).start()
    try:
        # The old version's pod served the tenant's prompts (its KV is the old weights':
        # only the token ids go to the new pod); the hottest was asked most.
        root = old_identity.root(tenant)
        prompts = [np.array(served.prompt(), np.uint32) for _ in range(3)]
        client = SidecarClient(old.socket)
        try:
            for i, tokens in enumerate(prompts):
                for _ in range(3 - i):
                    client.release(engine_io.request(client, root, tokens, block_bytes)[0])
                    client.store(root, tokens, prefill_kv(root, tokens, block, block_bytes))
        finally:
            client.close()

        budget = 2 * 192  # two prompts' stored blocks: the third, coldest, is left out
        member = Member(MemberName("old-sc"), "127.0.0.3", 1.0, fleet_namespace(tmp_path), "fleet")
        progress = rwio._Progress()
        stores_before = _sidecar_metric(served.sidecar, "kvtier_stores_total", outcome="accepted")
        # the warm-up is counted apart from traffic (its requests carry the marker)
        traffic_before = [_sidecar_metric(served.sidecar, m) for m in (
            "kvtier_lookups_total", "kvtier_engine_prompt_tokens_total")]
        warmup_before = _sidecar_metric(served.sidecar, "kvtier_warmup_lookups_total")

        async def warm() -> list[tuple[str, rw.Prompt]]:
            control = ControlClient.create(tls=ControlTls.from_ca(fleet_tls(tmp_path).ca_pem),
                                           http_port=int(old.http.rsplit(":", 1)[1]))
            try:
                hot = await control.hot(member, tenant, rw.ask_tokens(budget, 1))
            finally:
                await control.close()
            assert hot is not None and hot.prefixes, "the old version's sidecar named no hot prefixes"
            ranked = rw.rank([[rw.Prompt(tuple(p.token_ids), p.frequency) for p in hot.prefixes]])
            queue = [(x.tenant, x.prompt) for x in rw.plan({tenant: (1.0, ranked)}, budget)]
            async with aiohttp.ClientSession() as http:
                for t, p in queue:
                    assert await rwio._prefill(http, f"http://127.0.0.1:{served.port}{rwio.COMPLETIONS_PATH}",
                                               "tiny", t, p, progress), progress.engine_error
            return queue

        queue = asyncio.run(warm())
        warmed = [list(p.tokens) for _, p in queue]
        assert 1 <= len(warmed) <= 2 and all(t == tenant for t, _ in queue)
        assert warmed[0] == [int(x) for x in prompts[0]][: len(warmed[0])], "the hottest prefix goes first"
        assert progress.failed == 0 and not progress.engine_error
        wait_for("the warm-up's KV stored by the new pod's sidecar", lambda: _sidecar_metric(
            served.sidecar, "kvtier_stores_total", outcome="accepted") >= stores_before + len(warmed), 30)
        assert _sidecar_metric(served.sidecar, "kvtier_warmup_lookups_total") >= warmup_before + len(warmed)
        assert [_sidecar_metric(served.sidecar, m) for m in (
            "kvtier_lookups_total", "kvtier_engine_prompt_tokens_total")] == traffic_before, \
            "the warm-up's requests were counted as traffic"
    finally:
        old.kill()

    # vLLM's own prefix cache emptied: what the first request finds is kvtier's
    served.reset_prefix_cache()
    for tokens in warmed:
        first = _complete(served.port, tokens, tenant)
        recomputed = _complete(served.port, tokens, "warm-recompute")
        assert first["cached"] >= block * (len(tokens) // block) - block, first
        assert recomputed["cached"] == 0
        assert first["tokens"] == recomputed["tokens"]
