"""`kvtier demo`: the core library end to end, from the installed package alone.

The reference transformer (`kvtier_app.reference_transformer`) replays a multi-tenant
workload through an in-process `LocalCache`. Every request is served twice, once
through the cache (lookup -> materialize -> prefill only the suffix -> store) and once
by a full recompute, so the report gives MEASURED time saved and checks that cached KV
gave the same logits as recomputing; it ends with the break-even verdicts for the
model's own shape on this CPU and for a 70B model on H100 at TP4.

The fleet demo (Redis and sidecar processes on loopback) and the cluster demo (an
embedded Kubernetes, the Helm chart, injected sidecars) run real components from a
source checkout's test environment, which the wheel does not ship: there,
`./scripts/demo.sh` (`python -m kvtier_testenv.demo`) runs them, and this local mode too.
"""
from __future__ import annotations

import os

# One BLAS thread, set before numpy loads (it is first imported below when run as
# `kvtier demo`): the demo times small matmuls, and on a busy machine threaded BLAS
# spins against other processes and turns "measured time saved" into noise.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from typing import Callable  # noqa: E402

import numpy as np  # noqa: E402

from kvtier import breakeven, presets  # noqa: E402
from kvtier.cache import LocalCache  # noqa: E402
from kvtier.presets import Medium, ModelShape  # noqa: E402
from kvtier_app.reference_transformer import ReferenceTransformer, TransformerConfig  # noqa: E402

# Big enough that weight matmuls dominate a prefill (so the break-even formula
# applies to it), small enough that the whole demo runs in well under 30 s.
DEMO_MODEL = TransformerConfig(vocab=1024, layers=4, d_model=384, q_heads=6, kv_heads=2, ffn=1024)
SYSTEM_PROMPT_TOKENS = 128
DOC_TOKENS = 160
DOCS_PER_TENANT = 3
QUESTION_TOKENS = 24
ANSWER_TOKENS = 16
FOLLOW_UP_PROBABILITY = 0.4
MAX_TURNS = 3  # then the user starts a new conversation
DEFAULT_TENANTS = ("acme", "globex", "initech")
DEFAULT_REQUESTS = 30
CACHE_BYTES = 256 << 20


@dataclass(slots=True)
class Request:
    tenant: str
    tokens: np.ndarray
    kind: str  # "new" (system + doc + question) or "follow-up" (a conversation's next turn)


@dataclass(slots=True)
class LocalReplay:
    """What one local replay measured."""

    requests: int
    hits: int
    prompt_tokens: int
    tokens_saved: int
    cached_s: float
    recompute_s: float
    max_logit_diff: float
    materialize_gbps: float
    prefill_us_per_token: float
    engine_tflops: float
    per_tenant: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.tokens_saved / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def time_saved_s(self) -> float:
        return self.recompute_s - self.cached_s


def workload(tenants: tuple[str, ...], n_requests: int, seed: int, vocab: int) -> list[Request]:
    """Shared system prompts and RAG docs per tenant; conversations come back for more turns."""
    rng = np.random.default_rng(seed)

    def text(n: int) -> np.ndarray:
        return rng.integers(0, vocab, n, dtype=np.int64)

    system = {t: text(SYSTEM_PROMPT_TOKENS) for t in tenants}
    docs = {t: [text(DOC_TOKENS) for _ in range(DOCS_PER_TENANT)] for t in tenants}
    last: dict[str, tuple[np.ndarray, int]] = {}  # tenant -> (conversation so far, turns)
    out = []
    for _ in range(n_requests):
        tenant = tenants[int(rng.integers(len(tenants)))]
        prev, turns = last.get(tenant, (None, 0))
        if prev is not None and turns < MAX_TURNS and rng.random() < FOLLOW_UP_PROBABILITY:
            tokens = np.concatenate([prev, text(ANSWER_TOKENS), text(QUESTION_TOKENS)])
            kind, turns = "follow-up", turns + 1
        else:
            doc = docs[tenant][int(rng.integers(DOCS_PER_TENANT))]
            tokens = np.concatenate([system[tenant], doc, text(QUESTION_TOKENS)])
            kind, turns = "new", 1
        last[tenant] = (tokens, turns)
        out.append(Request(tenant, tokens, kind))
    return out


def run_local(
    tenants: tuple[str, ...] = DEFAULT_TENANTS,
    n_requests: int = DEFAULT_REQUESTS,
    seed: int = 0,
    config: TransformerConfig = DEMO_MODEL,
    progress: Callable[[str], None] | None = None,
) -> LocalReplay:
    """Replay the workload through a LocalCache and against full recompute."""
    engine = ReferenceTransformer(config)
    shape = config.kv_shape()
    cache = LocalCache(CACHE_BYTES, shape.block_bytes)
    requests = workload(tenants, n_requests, seed, config.vocab)
    prefill_s, flops = engine.measure()

    cached_s = recompute_s = 0.0
    hits = saved = prompt_tokens = 0
    max_diff = 0.0
    copy_bytes, copy_s = 0, 0.0
    per_tenant = {t: {"requests": 0, "hits": 0, "tokens_saved": 0} for t in tenants}
    for i, req in enumerate(requests):
        root = engine.key_root(req.tenant)
        t0 = time.perf_counter()
        hit = cache.lookup(root, req.tokens)
        past = None
        if hit:
            dst = np.empty(len(hit.blocks) * shape.block_bytes, dtype=np.uint8)
            c0 = time.perf_counter()
            cache.materialize(hit, dst)
            copy_s += time.perf_counter() - c0
            copy_bytes += dst.nbytes
            past = engine.past_from_blocks(dst)
        p0 = time.perf_counter()
        served = engine.prefill(req.tokens, past=past)
        p1 = time.perf_counter()
        cache.release(hit)
        cache.store(root, req.tokens, engine.kv_blocks(served))
        cached_s += time.perf_counter() - t0
        if hit:  # the baseline: recompute the whole prompt, and check the logits agree
            r0 = time.perf_counter()
            full = engine.prefill(req.tokens)
            recompute_s += time.perf_counter() - r0
            max_diff = max(max_diff, float(np.abs(served.logits[-1] - full.logits[-1]).max()))
        else:  # a miss was a full recompute already
            recompute_s += p1 - p0
        prompt_tokens += len(req.tokens)
        stats = per_tenant[req.tenant]
        stats["requests"] += 1
        if hit:
            hits += 1
            saved += hit.matched_tokens
            stats["hits"] += 1
            stats["tokens_saved"] += hit.matched_tokens
        if progress:
            progress(f"[{i + 1}/{len(requests)}] {req.tenant:<8} {req.kind:<9} {len(req.tokens):>4} tokens, "
                     f"{hit.matched_tokens:>4} from cache")
    cache.flush()
    return LocalReplay(
        requests=len(requests), hits=hits, prompt_tokens=prompt_tokens, tokens_saved=saved,
        cached_s=cached_s, recompute_s=recompute_s, max_logit_diff=max_diff,
        materialize_gbps=copy_bytes / copy_s / 1e9 if copy_s else 0.0,
        prefill_us_per_token=prefill_s * 1e6, engine_tflops=flops / 1e12, per_tenant=per_tenant,
    )


def verdicts(replay: LocalReplay, config: TransformerConfig = DEMO_MODEL) -> dict[str, breakeven.BreakEvenReport]:
    """Break-even for the engine's shape at its measured FLOP rate (with LocalCache's
    measured copy bandwidth as a medium), and for 70B on H100 at TP4."""
    own = ModelShape(name="reference-engine", layers=config.layers, kv_heads=config.kv_heads,
                     head_dim=config.head_dim, params=float(config.matmul_params))
    media = [Medium("localcache-measured", replay.materialize_gbps), *presets.MEDIA.values()]
    return {
        "engine": breakeven.evaluate(own, tflops_per_gpu=replay.engine_tflops, kv_dtype=config.dtype,
                                     media=media, gpu_name="this-cpu-measured"),
        "llama-3-70b/h100/tp4": breakeven.evaluate(presets.model_preset("llama-3-70b"),
                                                   tflops_per_gpu=presets.gpu_preset("h100").dense_tflops,
                                                   tp=4, gpu_name="h100"),
    }


def render(replay: LocalReplay, reports: dict[str, breakeven.BreakEvenReport]) -> str:
    r = replay
    lines = [
        f"kvtier demo (local): {r.requests} requests from {len(r.per_tenant)} tenants through LocalCache",
        f"  hit rate            {r.hit_rate:.0%} of requests, {r.token_hit_rate:.0%} of prompt tokens",
        f"  prefill tokens saved {r.tokens_saved:,} of {r.prompt_tokens:,}",
        f"  measured time       {r.cached_s:.2f} s with the cache vs {r.recompute_s:.2f} s recomputing "
        f"(saved {r.time_saved_s:.2f} s, {r.time_saved_s / r.recompute_s:.0%})" if r.recompute_s else "",
        f"  correctness         max |logit difference| vs full recompute: {r.max_logit_diff:.2e}",
        "  per tenant          " + ", ".join(
            f"{t}: {s['hits']}/{s['requests']} hits, {s['tokens_saved']:,} tokens" for t, s in r.per_tenant.items()),
        "",
    ]
    for name, rep in reports.items():
        lines.append(f"break-even, {name}: {rep.kv_bytes_per_token:,} B/token, "
                     f"{rep.prefill_us_per_token:.1f} us/token -> {rep.break_even_gbps:.3g} GB/s")
        for m in rep.media:
            lines.append(f"  {m.name:<20} {m.gbps:>9,.4g} GB/s {m.ratio:>12,.1f}x  {m.verdict}")
    return "\n".join(lines)


def main_local(args: argparse.Namespace) -> int:
    """`kvtier demo` (and `--mode local` of the checkout's demo)."""
    t0 = time.perf_counter()
    progress = None if args.json or args.quiet else (lambda s: print(s, file=sys.stderr))
    replay = run_local(n_requests=args.requests, seed=args.seed, progress=progress)
    reports = verdicts(replay)
    if args.json:
        out = {"mode": "local", **asdict(replay), "hit_rate": replay.hit_rate,
               "token_hit_rate": replay.token_hit_rate, "time_saved_s": replay.time_saved_s,
               "break_even": {k: v.model_dump() for k, v in reports.items()},
               "wall_s": time.perf_counter() - t0}
        print(json.dumps(out, indent=2))
    else:
        print(render(replay, reports))
        print(f"\n(done in {time.perf_counter() - t0:.1f} s)")
    return 0


CHECKOUT_MODES = ("cluster", "fleet")
"""The demos that run the test environment's components: `./scripts/demo.sh --mode M` in
a source checkout (`kvtier_testenv.demo`)."""


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number > 0, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options every demo mode takes (the checkout's demo adds its own)."""
    p.add_argument("--requests", type=positive_int, default=DEFAULT_REQUESTS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no per-request progress lines")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvtier demo", description=__doc__.split("\n\n")[0],
                                epilog="The fleet and cluster demos run from a source checkout: ./scripts/demo.sh")
    p.add_argument("--mode", default="local",
                   help="local (the only mode installed with kvtier): the reference transformer and an "
                        "in-process LocalCache")
    add_arguments(p)
    args = p.parse_args(argv)
    if args.mode in CHECKOUT_MODES:
        p.error(f"--mode {args.mode} runs the test environment's components, which are not installed with "
                f"kvtier: in a source checkout, run ./scripts/demo.sh --mode {args.mode}")
    if args.mode != "local":
        p.error(f"--mode: only 'local' is installed with kvtier, got {args.mode!r}")
    return main_local(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
