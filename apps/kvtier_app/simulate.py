"""`kvtier simulate`: what kvtier would do to a fleet's hit rate and prefill bill.

    kvtier simulate                        # the design notes' fleet, 1M requests
    kvtier simulate compare --requests 50000 --policies random,kvtier,oracle
    kvtier simulate capacity --plots out/  # hit rate vs DRAM per policy, as PNG
    kvtier simulate all --json report.json --plots out/
    kvtier simulate rollout-design-notes   # warm-before-ready vs cold rollouts, design fleet
    kvtier simulate rollout-trace          # ... on the shipped trace (or --trace FILE)
    kvtier simulate trace requests.jsonl   # replay recorded traffic (see `trace --help`)

Exit status: 0 on success, 2 on a bad flag (the message names it).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvtier.sim import scenarios
from kvtier.sim.routers import ROUTERS
from kvtier_app.progress import terminal_progress

SCENARIOS = ("design-notes", "compare", "capacity", "membership", "rollout", "rollout-design-notes",
             "rollout-trace", "thrash")
# The shipped trace `rollout-trace` replays unless --trace names another.
SHIPPED_TRACE = Path(__file__).resolve().parents[2] / "bench" / "traces" / "mooncake_conversation_trace.jsonl.gz"
# Requests per scenario when --requests is not given (the full-size runs).
DEFAULT_REQUESTS = {"design-notes": 1_000_000, "compare": 100_000, "capacity": 50_000,
                    "membership": 90_000, "rollout": 81_000, "thrash": 40_000,
                    "rollout-design-notes": 0, "rollout-trace": 0}  # 0: as long as the rollout needs


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier simulate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", nargs="?", default="design-notes", choices=SCENARIOS + ("all",),
                   help="what to simulate (default: design-notes)")
    p.add_argument("--requests", type=int, help="requests per run (default depends on the scenario)")
    p.add_argument("--policies", help=f"comma-separated routing policies for compare/capacity/design-notes "
                                      f"(known: {', '.join(ROUTERS)})")
    p.add_argument("--cache", choices=("kvtier", "lru"), default="kvtier",
                   help="replica cache for compare: kvtier's LocalCache (admission) or plain LRU (default kvtier)")
    p.add_argument("--dram-gib", help="comma-separated DRAM sizes per replica for capacity (GiB)")
    p.add_argument("--tenants", type=int, default=200,
                   help="rollout-design-notes: tenants (of 2,000; rate, DRAM and warm-up budget scale with them; "
                        "default 200)")
    p.add_argument("--warm-tokens", type=int,
                   help="rollout scenarios: the per-pod warm-up budget in prompt tokens, as the operator's "
                        "spec.rollout.warmup.maxTokens (default its 65536, scaled with --tenants)")
    p.add_argument("--trace", metavar="FILE", help="rollout-trace: the trace (default the shipped Mooncake trace)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--json", metavar="PATH", help="write the full report as JSON ('-' for stdout)")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots into DIR")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _fail(flag: str, message: str) -> int:
    print(f"kvtier simulate: error: {flag}: {message}", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    if argv and argv[0] == "trace":
        from kvtier_app import trace_cli

        return trace_cli.main(argv[1:])
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse already printed the message naming the flag
        return int(exc.code or 0)
    if args.requests is not None and args.requests < 1:
        return _fail("--requests", f"must be >= 1, got {args.requests}")
    policies = None
    if args.policies:
        policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
        unknown = [p for p in policies if p not in ROUTERS]
        if unknown or not policies:
            return _fail("--policies", f"unknown policy {', '.join(unknown) or '(none given)'}; "
                                       f"choose from {', '.join(ROUTERS)}")
    dram = None
    if args.dram_gib:
        try:
            dram = tuple(float(x) for x in args.dram_gib.split(","))
        except ValueError:
            return _fail("--dram-gib", f"expected comma-separated numbers, got {args.dram_gib!r}")
        if any(x <= 0 for x in dram):
            return _fail("--dram-gib", "sizes must be > 0")
    if args.tenants < 1 or args.tenants > 2_000:
        return _fail("--tenants", f"must be 1..2000, got {args.tenants}")
    if args.warm_tokens is not None and args.warm_tokens < 0:
        return _fail("--warm-tokens", f"must be >= 0 (0: cold), got {args.warm_tokens}")
    if args.trace and not Path(args.trace).is_file():
        return _fail("--trace", f"no such file: {args.trace}")
    names = SCENARIOS if args.scenario == "all" else (args.scenario,)
    progress = terminal_progress(args.no_progress)
    reports = []
    from kvtier.sim.report import render, to_json

    for name in names:
        n = args.requests or DEFAULT_REQUESTS[name]
        rep = _run(name, n, policies, dram, args.seed, progress, args.cache, args)
        reports.append(rep)
        if args.json != "-":
            print(render(rep), flush=True)
            print()
    if args.json:
        text = to_json(reports)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)
            print(f"wrote {args.json}")
    if args.plots:
        from kvtier_app.plots import plot

        for rep in reports:
            for path in plot(rep, Path(args.plots)):
                print(f"wrote {path}", file=sys.stderr if args.json == "-" else sys.stdout)
    return 0


def _run(name, n, policies, dram, seed, progress, cache="kvtier", args=None):
    if name == "rollout-design-notes":
        return scenarios.design_rollout(args.tenants, args.requests, progress=progress, seed=seed,
                                        warm_tokens=args.warm_tokens)
    if name == "rollout-trace":
        warm = scenarios.WARM_BEFORE_READY_TOKENS if args.warm_tokens is None else args.warm_tokens
        return scenarios.trace_rollout(args.trace or SHIPPED_TRACE, progress=progress, warm_tokens=warm)
    if name == "design-notes":
        return scenarios.design_notes(n, policies or ("kvtier", "random", "oracle"), progress=progress, seed=seed)
    if name == "compare":
        return scenarios.default_compare(n, policies or scenarios.COMPETITORS, progress=progress, seed=seed,
                                         cache=cache)
    if name == "capacity":
        return scenarios.default_capacity(n, policies or scenarios.COMPETITORS, dram or (5, 10, 20, 40, 80),
                                          progress=progress, seed=seed)
    if name == "membership":
        return scenarios.default_membership(n, progress=progress, seed=seed)
    if name == "rollout":
        return scenarios.default_rollout(n, progress=progress, seed=seed)
    return scenarios.default_thrash(n, progress=progress, seed=seed)
