"""`kvtier simulate trace FILE`: replay recorded traffic through kvtier and its baselines.

    kvtier simulate trace requests.jsonl                      # capacity sweep, one cache
    kvtier simulate trace t.jsonl.gz --capacities 0.01,3M,0.1 --json out.json --plots out/
    kvtier simulate trace t.jsonl --ablation                  # what each part of the policy buys
    kvtier simulate trace t.jsonl --fleet 8 --capacities 0.02 # routing policies across 8 replicas
    kvtier simulate trace t.jsonl --jobs 1                    # one replay at a time (default: one per CPU)

Capacities are shares of the trace's distinct full blocks (0.05 or 5%) or token counts
(3M, 250000). Exit status: 0 on success, 2 on a bad flag or a bad trace (the message
names the flag, or the file and line).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kvtier.sim.routers import ROUTERS
from kvtier.sim.replay import (
    BASELINES,
    DEFAULT_CAPACITIES,
    DEFAULT_SINGLE_POLICIES,
    KVTIER_VARIANTS,
    SINGLE_POLICIES,
    TraceReport,
    capacity_blocks,
    fleet,
    sweep,
)
from kvtier.sim.trace import DEFAULT_BLOCK_ELEMS, DEFAULT_TRACE_BLOCK_TOKENS, TraceError, load_trace
from kvtier_app.progress import terminal_progress

DEFAULT_FLEET_POLICIES = ("random", "round-robin", "chash-session", "precise-prefix", "sglang", "kvtier")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier simulate trace", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", help="JSONL trace (timestamp ms, input_length, output_length, hash_ids); .gz is fine")
    p.add_argument("--trace-block-tokens", type=int, default=DEFAULT_TRACE_BLOCK_TOKENS,
                   help=f"tokens per hash id in the trace (default {DEFAULT_TRACE_BLOCK_TOKENS})")
    p.add_argument("--block-elems", type=int, default=DEFAULT_BLOCK_ELEMS,
                   help=f"token elements per hash id in replay (default {DEFAULT_BLOCK_ELEMS})")
    p.add_argument("--capacities", default=",".join(DEFAULT_CAPACITIES),
                   help=f"comma-separated capacities (default {','.join(DEFAULT_CAPACITIES)}); per replica "
                        "with --fleet")
    p.add_argument("--policies", help="comma-separated: cache policies for one cache "
                                      f"({', '.join(SINGLE_POLICIES)}), routing policies with --fleet "
                                      f"({', '.join(ROUTERS)})")
    p.add_argument("--ablation", action="store_true", help="add every kvtier-* variant (one part switched off)")
    p.add_argument("--fleet", type=int, metavar="N", help="replay across N replicas, one run per routing policy")
    p.add_argument("--requests", type=int, help="replay only the first N requests")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON ('-' for stdout)")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots into DIR")
    p.add_argument("--jobs", type=int, default=_cpus(),
                   help=f"replays run side by side in this many processes (default: the CPUs this process "
                        f"may use, here {_cpus()}); the results do not depend on it")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (fleet mode)")
    return p


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _fail(flag: str, message: str) -> int:
    print(f"kvtier simulate trace: error: {flag}: {message}", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    for flag, value in (("--trace-block-tokens", args.trace_block_tokens), ("--block-elems", args.block_elems),
                        ("--requests", args.requests), ("--fleet", args.fleet),
                        ("--jobs", args.jobs)):
        if value is not None and value < 1:
            return _fail(flag, f"must be >= 1, got {value}")
    known = ROUTERS if args.fleet else SINGLE_POLICIES
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip()) if args.policies else \
        (DEFAULT_FLEET_POLICIES if args.fleet else DEFAULT_SINGLE_POLICIES)
    unknown = [p for p in policies if p not in known]
    if unknown or not policies:
        return _fail("--policies", f"unknown policy {', '.join(unknown) or '(none given)'}; choose from "
                                   f"{', '.join(known)}")
    if args.ablation and not args.fleet:
        policies = tuple(dict.fromkeys(tuple(KVTIER_VARIANTS) + policies))
    try:
        trace = load_trace(args.file, args.trace_block_tokens)
    except TraceError as exc:
        return _fail(args.file, str(exc))
    if args.requests:
        trace = trace.head(args.requests)
    try:
        caps = sorted({capacity_blocks(c, trace) for c in args.capacities.split(",") if c.strip()})
    except TraceError as exc:
        return _fail("--capacities", str(exc))
    if not caps:
        return _fail("--capacities", "give at least one capacity")
    try:
        if args.fleet:
            return _fleet(args, trace, caps, policies)
        report = sweep(trace, caps, policies, args.block_elems, name=Path(args.file).name, jobs=args.jobs)
    except TraceError as exc:
        return _fail(args.file, str(exc))
    _emit(args, render(report), report.as_dict(), lambda out: plot(report, out))
    return 0


def _fleet(args, trace, caps, policies) -> int:
    from kvtier.sim.report import render as render_scenario
    from kvtier_app.plots import plot as plot_scenario

    progress = terminal_progress(args.no_progress)
    reports = [fleet(trace, args.fleet, blocks, policies, args.block_elems, progress) for blocks in caps]
    _emit(args, "\n\n".join(render_scenario(r) for r in reports), [r.as_dict() for r in reports],
          lambda out: [p for r in reports for p in plot_scenario(r, out)])
    return 0


def _emit(args, text: str, data, make_plots) -> None:
    if args.json != "-":
        print(text, flush=True)
    if args.json:
        body = json.dumps(data, indent=2)
        if args.json == "-":
            print(body)
        else:
            Path(args.json).write_text(body)
            print(f"wrote {args.json}")
    if args.plots:
        for path in make_plots(Path(args.plots)):
            print(f"wrote {path}", file=sys.stderr if args.json == "-" else sys.stdout)


# ---------------------------------------------------------------------- output

def render(rep: TraceReport) -> str:
    """The sweep as a table: one row per capacity, one column per policy."""
    p = rep.params
    lines = [f"== trace {rep.name}: {p['requests']:,} requests, {p['prompt_tokens']:,} prompt tokens, "
             f"{p['unique_blocks']:,} distinct full blocks of {p['tokens_per_hash_id']} tokens "
             f"({p['elements_per_block']} elements each in replay), {p['span_s']:.0f} s"]
    policies = list(dict.fromkeys(pt.policy for pt in rep.points))
    infinite = [pt for pt in rep.points if pt.policy == "infinite"]
    columns = [q for q in policies if q != "infinite"]
    lines.append("")
    lines.append(f"{'capacity':>26} " + " ".join(f"{q:>20}" for q in columns) + "  kvtier/LRU")
    for blocks in p["capacities_blocks"]:
        row = {pt.policy: pt for pt in rep.points if pt.capacity_blocks == blocks}
        any_pt = next(iter(row.values()))
        label = f"{blocks:,} blk {any_pt.capacity_tokens / 1e6:.1f}M tok {any_pt.capacity_fraction:6.1%}"
        cells = [f"{row[q].hit_rate:20.4f}" if q in row else f"{'':>20}" for q in columns]
        ratio = ""
        if "kvtier" in row and "lru" in row and row["lru"].hit_rate:
            ratio = f"{row['kvtier'].hit_rate / row['lru'].hit_rate:10.3f}x"
        lines.append(f"{label:>26} " + " ".join(cells) + "  " + ratio)
    if infinite:
        lines.append(f"   infinite capacity: {infinite[0].hit_rate:.4f}")
    speed = [pt for pt in rep.points if pt.policy == "kvtier"]
    if speed:
        rates = ", ".join(f"{pt.requests_per_s:,.0f}" for pt in speed)
        lines.append(f"   kvtier replay speed (requests/s, wall, per capacity): {rates}")
    lines.append("   token hit rate = matched prompt tokens / prompt tokens; at least one token is always "
                 "computed; belady = offline reference (knows the future)")
    return "\n".join(lines)


def plot(rep: TraceReport, out_dir: Path) -> list[Path]:
    """Hit rate vs capacity, one curve per policy, infinite capacity as a line."""
    from kvtier_app.plots import _label, _pyplot, _save

    out_dir.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    curves: dict[str, list[tuple[float, float]]] = {}
    infinite = None
    for pt in rep.points:
        if pt.policy == "infinite":
            infinite = pt.hit_rate
            continue
        curves.setdefault(pt.policy, []).append((pt.capacity_fraction, pt.hit_rate))
    for policy, pts in curves.items():
        pts.sort()
        style = "--" if policy in BASELINES else "-"
        ax.plot([x for x, _ in pts], [y for _, y in pts], style, marker="o", label=policy,
                linewidth=2.5 if policy == "kvtier" else 1.2)
    if infinite is not None:
        ax.axhline(infinite, color="k", linestyle=":", label="infinite capacity")
    ax.set_xscale("log")
    _label(ax, "cache capacity (share of the trace's distinct blocks)", "token hit rate (prefill avoided)",
           f"Hit rate vs capacity: {rep.name}")
    return [_save(fig, plt, out_dir / "trace_hit_rate_vs_capacity.png")]
