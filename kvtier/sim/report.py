"""Terminal tables and JSON for scenario reports."""
from __future__ import annotations

import json

from kvtier.sim.scenarios import ScenarioReport

_COLUMNS = (
    ("run", "{:<34}", lambda r: r.label[:34]),
    ("hit rate", "{:>9}", lambda r: f"{r.hit_rate:.3f}"),
    ("req hit", "{:>8}", lambda r: f"{r.request_hit_rate:.3f}"),
    ("prefill rep-s", "{:>14}", lambda r: f"{r.prefill_replica_s:,.0f}"),
    ("max/mean", "{:>9}", lambda r: f"{r.load_imbalance:.3f}"),
    ("TTFT p50", "{:>9}", lambda r: f"{r.ttft_p50_s * 1e3:.0f}ms"),
    ("TTFT p99", "{:>10}", lambda r: _ms(r.ttft_p99_s)),
    ("spill", "{:>6}", lambda r: f"{r.spill_rate:.3f}"),
    ("evictions", "{:>11}", lambda r: f"{r.evictions:,}"),
    ("cpu", "{:>7}", lambda r: f"{r.cpu_s:.1f}s"),
)


def _ms(s: float) -> str:
    return f"{s * 1e3:.0f}ms" if s < 10 else f"{s:.0f}s"


def render(rep: ScenarioReport) -> str:
    """A scenario as text: parameters, one row per run, figures against targets, notes."""
    lines = [f"== {rep.name}: {rep.description}"]
    for k, v in rep.params.items():
        lines.append(f"   {k}: {_fmt(v)}")
    if rep.results:
        lines.append("")
        lines.append(" ".join(fmt.format(name) for name, fmt, _ in _COLUMNS))
        for r in rep.results:
            lines.append(" ".join(fmt.format(get(r)) for _, fmt, get in _COLUMNS))
    if rep.figures:
        lines.append("")
        for f in rep.figures:
            target = ""
            if f.target is not None:
                op = ">=" if f.direction == "higher" else "<="
                target = f"  target {op} {f.target:.3g}  {'PASS' if f.passed else 'FAIL'}"
            base = f"  (baseline {f.baseline_name} = {f.baseline:.4g})" if f.baseline is not None else ""
            note = f"  [{f.note}]" if f.note else ""
            lines.append(f"   {f.name}: {f.value:.4g} {f.unit}{target}{base}{note}")
    for n in rep.notes:
        lines.append(f"   note: {n}")
    return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def to_json(reports: list[ScenarioReport], series: bool = True) -> str:
    return json.dumps([r.as_dict(series) for r in reports], indent=2)
