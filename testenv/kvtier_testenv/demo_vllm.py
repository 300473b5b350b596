"""`python -m kvtier_testenv.demo --mode cluster --engine vllm` (or `./scripts/demo.sh --engine
vllm`): the cluster demo on the two real nodes with real vLLM servers as the serving pods.

    the real nodes + Redis + Prometheus + `helm install charts/kvtier` (as in the
    cluster demo, `demo_nodes`)
      -> KVCachePolicy for a tiny Llama (seeded random weights, float32, block 32)
      -> StatefulSet of 2 pods whose engine container is vLLM's OpenAI server (the CPU
         build from hack/vllm.sh, mounted from the host: `kvtier_testenv.vllm_pod`), run
         by kubelet; the webhook injects the native sidecar and the engine env, and the
         engine's command line is just `... --kv-transfer-config $(KVTIER_KV_TRANSFER_CONFIG)`
      -> a multi-tenant replay over HTTP from the host to the pods, each request routed
         by the published affinity table and carrying its tenant as `cache_salt`; every
         answer is checked against the same prompt recomputed under a salt of its own (a
         guaranteed miss)
      -> `kubectl get kvcp`, the hits the engines report (cached prompt tokens) and the
         sidecars' /metrics

Any wrong answer, request error or missing step exits non-zero; everything is torn
down at the end.
"""
from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from kvtier import control_api, names
from kvtier.policy import API_VERSION
from kvtier_testenv import vllm_pod
from kvtier_testenv.control_client import post_json
from kvtier_testenv.demo_cluster import (
    APP_LABEL,
    NAMESPACE,
    POLICY,
    SERVING_SERVICE_ACCOUNT,
    WORKLOAD,
    DemoFailed,
    wait_for,
)
from kvtier_testenv.demo_nodes import NodesDemo

REPLICAS = 2
ENGINE_PORT = 8000
WEIGHTS = "sha256:" + "d1" * 32
TENANTS = 6
TEMPLATES = 2
TEMPLATE_TOKENS = (96, 160)
MAX_TOKENS = 4
REQUEST_TIMEOUT_S = 300.0
# vLLM hands a finished request's blocks to its sidecar after it answers; on a loaded
# machine that can take seconds.
STORE_TIMEOUT_S = 120.0


def policy_manifest(shape: Any, redis_url: str) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION, "kind": "KVCachePolicy",
        "metadata": {"name": POLICY, "namespace": NAMESPACE},
        "spec": {
            "selector": {"matchLabels": {"app": APP_LABEL}},
            "model": {"id": "tiny-llama", "weightsVersion": WEIGHTS, "kvDtype": "fp32",
                      "ropeConfigHash": "rope-tiny", "attnImpl": "cpu-attn",
                      "shape": {"layers": shape.layers, "kvHeads": shape.kv_heads, "headDim": shape.head_dim,
                                "params": 1e7}},
            "hardware": {"denseTflopsPerGpu": 1}, "blockSize": 32, "admission": {"minSightings": 1},
            "tiers": {"dram": {"capacity": "64Mi"}, "nvme": {"mode": "off"}},
            "affinity": {"homes": 1},
            "redis": {"url": redis_url},
        },
    }


def statefulset_manifest(engine: dict[str, Any], volumes: list[dict[str, Any]]) -> dict[str, Any]:
    """The vLLM pods, one per node."""
    labels = {"app": APP_LABEL}
    spread = {"labelSelector": {"matchLabels": labels}, "topologyKey": "kubernetes.io/hostname"}
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": WORKLOAD, "namespace": NAMESPACE},
        "spec": {
            "replicas": REPLICAS, "serviceName": WORKLOAD, "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels, "annotations": {names.WEIGHTS_VERSION_ANNOTATION: WEIGHTS}},
                "spec": {"terminationGracePeriodSeconds": 5,
                         # may create TokenReviews: the sidecar checks the operator's token
                         "serviceAccountName": SERVING_SERVICE_ACCOUNT,
                         "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                         "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [spread]}},
                         "containers": [engine], "volumes": volumes},
            },
        },
    }


class VllmNodesDemo(NodesDemo):
    """The real nodes' demo set-up, its serving namespace at the level the vLLM pods'
    mounted venv needs (`vllm_pod.POD_SECURITY`)."""

    pod_security = vllm_pod.POD_SECURITY
    where = "two real nodes (kubelet, containerd), vLLM servers (the CPU build) as the engines in the pods"


def _complete(ip: str, prompt: list[int], salt: str) -> tuple[list[int], int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "cache_salt": salt,
            "return_token_ids": True}
    status, raw = post_json(ip, ENGINE_PORT, "/v1/completions", body, REQUEST_TIMEOUT_S)
    if status != 200:  # an OSError, as urlopen's HTTPError was: the callers count it as a failure
        raise OSError(f"http://{ip}:{ENGINE_PORT}/v1/completions answered {status}: {raw[:300]!r}")
    out = json.loads(raw)
    details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
    return out["choices"][0]["token_ids"], int(details.get("cached_tokens") or 0)


def _tenant_stores(demo: NodesDemo, member: str, ip: str, tenant: str) -> int:
    """Stores the member's sidecar got for the tenant: accepted, declined or already held."""
    st = demo.sidecar_stats(member, ip, tenant)
    return st["stores"] + st["stores_declined"] + st["stores_cached"]


def _hit_tokens(demo: NodesDemo, ip: str) -> float:
    status, raw = demo.sidecar_control(ip).get(control_api.METRICS.path)
    if status != 200:
        raise DemoFailed(f"sidecar {ip} /metrics answered {status}")
    text = raw.decode()
    return sum(float(m.group(1)) for m in re.finditer(r'^kvtier_prefix_cache_hits_total\{[^}]*\} (\S+)$', text, re.M))


def run(requests: int, seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    from kvtier import routing
    from kvtier_testenv.tiny_llama import TinyLlama, write_model
    from kvtier_testenv.vllm_engine import vllm_python
    from kvtier_testenv.workload import make_workload

    workdir = Path(tempfile.mkdtemp(prefix="kvtier-vllm-demo-"))
    shape = TinyLlama()
    vllm_python()  # fails here, before any set-up, when hack/vllm.sh has not run
    model = write_model(workdir / "model", seed=seed)
    demo = VllmNodesDemo(workdir, log)
    try:
        demo.start()
        demo.step(f"kubectl apply KVCachePolicy {POLICY} (tiny Llama served by vLLM)")
        demo.kubectl.apply(policy_manifest(shape, demo.redis_url))
        wait_for("tier verdicts in the policy's status", lambda: demo.status().get("tiers"))
        demo.step(f"StatefulSet {WORKLOAD}: {REPLICAS} vLLM servers; the webhook injects the sidecar and "
                  "the engine env (--kv-transfer-config rendered from the policy)")
        sts = statefulset_manifest(*vllm_pod.engine_pod_spec(demo.project_image(), model, ENGINE_PORT))
        demo.wait_injecting(sts)
        demo.kubectl.apply(sts)
        pods = demo._wait_pods(NAMESPACE, f"app={APP_LABEL}", REPLICAS, vllm_pod.READY_TIMEOUT_S,
                               crash_loop="engine")
        for pod in pods:
            containers = [c["name"] for c in demo.sidecar_containers(pod) + pod["spec"]["containers"]]
            if "kvtier-sidecar" not in containers:
                raise DemoFailed(f"pod {pod['metadata']['name']} was not injected: containers {containers}")
        nodes = sorted(p["spec"]["nodeName"] for p in pods)
        demo.step(f"{REPLICAS} vLLM pods Ready on " + ", ".join(nodes))
        wait_for(f"an epoch with {REPLICAS} members",
                 lambda: demo.table() and len(demo.table()[0].members) == REPLICAS)
        table, addresses = demo.table()
        work = make_workload(TENANTS, TEMPLATES, requests, seed=seed, vocab=shape.vocab,
                             template_tokens=TEMPLATE_TOKENS)
        demo.step(f"replaying {len(work)} requests over HTTP (cache_salt = tenant) under epoch {table.epoch}")
        served = wrong = errors = cached_tokens = prompt_tokens = hits = 0
        samples: list[str] = []
        for i, req in enumerate(work):
            member = routing.pick(req.tenant, table, {}).member
            ip = addresses[member]["ip"]
            try:
                stored = _tenant_stores(demo, member, ip, req.tenant)
                tokens, cached = _complete(ip, req.tokens, req.tenant)
                if cached == 0:
                    # A miss: vLLM prefilled the whole prompt and hands its blocks to the
                    # sidecar after it answers. The tenant's next request is sent once they
                    # arrived, so that whether it hits does not race the store.
                    wait_for(f"{req.tenant}'s blocks handed to {member}'s sidecar",
                             lambda: _tenant_stores(demo, member, ip, req.tenant) > stored, STORE_TIMEOUT_S)
                recomputed, _ = _complete(ip, req.tokens, f"recompute-{seed}-{i}")
            except OSError as exc:
                errors += 1
                samples.append(f"{req.tenant}: {exc}")
                continue
            served += 1
            prompt_tokens += len(req.tokens)
            cached_tokens += cached
            hits += cached > 0
            if tokens != recomputed:
                wrong += 1
                samples.append(f"{req.tenant}: {tokens} != recompute {recomputed}")
        metrics = {m: _hit_tokens(demo, addresses[m]["ip"]) for m in sorted(table.members)}
        fleet_hit_rate = demo.wait_fleet_hit_rate()
        kvcp = demo.kubectl.run("get", "kvcp", "-o", "wide").stdout.rstrip()
    finally:
        demo.close()
    ok = wrong == 0 and errors == 0 and hits > 0
    if ok:  # a failed run keeps its workdir (logs, configs) for the diagnosis
        shutil.rmtree(workdir, ignore_errors=True)
    return {"ok": ok, "kubectl_get_kvcp": kvcp, "fleet_hit_rate": fleet_hit_rate,
            "requests": len(work),
            "served": served, "hits": hits, "cached_tokens": cached_tokens, "prompt_tokens": prompt_tokens,
            "wrong_answers": wrong, "errors": errors, "samples": samples[:3],
            "sidecar_hit_tokens": metrics, "epoch": table.epoch, "nodes": nodes}


def render(r: dict[str, Any]) -> str:
    lines = [f"kvtier cluster demo with vLLM: {REPLICAS} vLLM servers (CPU build) in injected pods on "
             f"{len(set(r['nodes']))} real node(s)", "",
             "$ kubectl get kvcp -o wide", r["kubectl_get_kvcp"], "",
             f"requests            {r['requests']} ({r['served']} served, {r['errors']} errors)",
             f"hits                {r['hits']} requests, {r['cached_tokens']:,} of {r['prompt_tokens']:,} prompt "
             "tokens loaded from kvtier (vLLM's own prefix cache off)",
             f"wrong answers       {r['wrong_answers']} (each checked against the prompt recomputed)",
             "sidecar /metrics    " + ", ".join(f"{m}: kvtier_prefix_cache_hits_total {v:,.0f}"
                                                 for m, v in r["sidecar_hit_tokens"].items())]
    if r["samples"]:
        lines.append(f"samples             {r['samples']}")
    return "\n".join(lines)


def main(args) -> int:
    """`--mode cluster --engine vllm` of the checkout's demo (dispatched by kvtier_testenv.demo)."""
    import sys
    import time

    t0 = time.perf_counter()
    log = (lambda s: None) if args.quiet or args.json else (lambda s: print(s, file=sys.stderr, flush=True))
    try:
        result = run(requests=args.requests, seed=args.seed, log=log)
    except (DemoFailed, TimeoutError, RuntimeError) as exc:
        print(f"demo --engine vllm: FAILED: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"mode": "cluster", "engine": "vllm", **result, "wall_s": time.perf_counter() - t0},
                         indent=2))
    else:
        print(render(result))
        print(f"\n(done in {time.perf_counter() - t0:.1f} s)")
    return 0 if result["ok"] else 1
