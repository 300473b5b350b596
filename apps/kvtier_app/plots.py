"""PNG plots of scenario reports (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

from pathlib import Path

from kvtier.sim.scenarios import ScenarioReport


def _label(ax, xlabel: str, ylabel: str, title: str) -> None:
    """Axis labels, title, legend and grid, the same on every line plot."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(rep: ScenarioReport, out_dir: Path) -> list[Path]:
    """Write the plots that fit this scenario into out_dir; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    makers = {"capacity": [_capacity], "membership": [_over_time], "rollout": [_over_time, _prefill_over_time],
              "compare": [_imbalance], "design-notes": [_imbalance], "thrash": [_over_time],
              "trace-fleet": [_imbalance]}
    return [m(rep, out_dir) for m in makers.get(rep.name, [])]


def _capacity(rep: ScenarioReport, out_dir: Path) -> Path:
    plt = _pyplot()
    curves: dict[str, list[tuple[float, float]]] = {}
    oracle = None
    for r in rep.results:
        policy, _, size = r.label.partition("@")
        if policy == "oracle":
            oracle = r.hit_rate
            continue
        curves.setdefault(policy, []).append((float(size.removesuffix("GiB")), r.hit_rate))
    fig, ax = plt.subplots(figsize=(8, 5))
    for policy, pts in curves.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy,
                linewidth=2.5 if policy == "kvtier" else 1.2)
    if oracle is not None:
        ax.axhline(oracle, color="k", linestyle="--", label="oracle (infinite, perfect routing)")
    ax.set_xscale("log")
    sizes = sorted({x for pts in curves.values() for x, _ in pts})
    ax.set_xticks(sizes, [f"{x:g}" for x in sizes])
    ax.minorticks_off()
    _label(ax, "DRAM tier per replica (GiB)", "token hit rate (prefill avoided)", "Hit rate vs DRAM capacity per routing policy")
    return _save(fig, plt, out_dir / "hit_rate_vs_capacity.png")


def _over_time(rep: ScenarioReport, out_dir: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5))
    for r in rep.results:
        ax.plot(r.series_t_s, r.series_hit_rate, label=r.label)
    seen = set()
    for r in rep.results:
        for ev in r.events:
            key = (ev["time_s"], ev["kind"])
            if key in seen:
                continue
            seen.add(key)
            ax.axvline(ev["time_s"], color="grey", alpha=0.3, linewidth=0.8)
    _label(ax, "simulated time (s)", "token hit rate per bucket", f"Hit rate over time: {rep.name}")
    return _save(fig, plt, out_dir / f"hit_rate_over_time_{rep.name}.png")


def _prefill_over_time(rep: ScenarioReport, out_dir: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5))
    for r in rep.results:
        ax.plot(r.series_t_s[:-1], r.series_prefill_load[:-1], label=r.label)
    _label(ax, "simulated time (s)", "prefill load (replicas' worth of prefill)", f"Prefill load over time: {rep.name}")
    return _save(fig, plt, out_dir / f"prefill_load_{rep.name}.png")


def _imbalance(rep: ScenarioReport, out_dir: Path) -> Path:
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    labels = [r.label for r in rep.results]
    ax1.bar(labels, [r.load_imbalance for r in rep.results], color="tab:orange")
    ax1.axhline(1.25, color="k", linestyle="--", linewidth=0.8)
    ax1.set_ylabel("max / mean replica load")
    ax1.set_title("Load imbalance per policy")
    ax2.bar(labels, [r.hit_rate for r in rep.results], color="tab:blue")
    ax2.set_ylabel("token hit rate")
    ax2.set_title("Hit rate per policy")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=45, labelsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return _save(fig, plt, out_dir / f"load_imbalance_{rep.name}.png")


def _save(fig, plt, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
