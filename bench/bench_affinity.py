"""Affinity planner: a membership change for 1,000 pods and 20,000 tenants, with bounded loads.

No member may be home to more than balanceFactor (1 + epsilon = 1.25) x the mean.
A plan is timed both ways the operator can plan: warm (it kept the previous plan's
assignment in memory) and cold (after a restart it re-ranks the old members first).
Both are measured against plain rendezvous over the same members and tenants, timed
in the same run: scoring every tenant against every member and taking its top k is
the work any rendezvous planner must do, so it scales with the machine exactly as
the plan does, and the ratio is the planner's own overhead (the bounded loads, the
diff against the old table). Measured on the 2-core dev machine the cold plan costs
about 1x of it and the warm plan, which skips the re-ranking, 0.1-0.15x; the targets
(2x and 0.5x) leave room for noise without letting the planner double its cost. Movement is reported against the
minimum plain rendezvous would need (the newcomer's tenants on a join, the
departed member's on a leave), with the extra the caps displace; the max/mean
home load of plain rendezvous, measured in the same run, is the baseline the
bound is set against. The override map is what routers need beyond the members:
its entry count and JSON size show it fits a ConfigMap (1 MiB).
"""
from __future__ import annotations

from bench.common import Result, best_of
from kvtier.affinity import AffinityTable, assign, load_imbalance, plan_membership_change

# A plan may cost this many plain-rendezvous assignments of the same fleet (see above).
COLD_PLAN_RATIO = 2.0
WARM_PLAN_RATIO = 0.5
BALANCE_FACTOR = 1.25  # max/mean home load <= 1 + epsilon (the CRD default)
CONFIGMAP_BYTES = 1 << 20  # a ConfigMap's data is capped at 1 MiB
MOVEMENT_BOUND = 2.0  # moved tenants <= 2x the minimum plain rendezvous needs (the caps displace the rest)
N_PODS, N_TENANTS, K = 1000, 20_000, 3
# The design fleet (docs/ARCHITECTURE.md "The numbers"): ~136 tenants per replica at k = 3.
DESIGN_PODS, DESIGN_TENANTS = 44, 2000


def run(quick: bool = False) -> list[Result]:
    repeat = 2 if quick else 5
    pods = {f"vllm-llama-70b-{i:04d}": 1.0 for i in range(N_PODS)}
    tenants = [f"tenant-{i:05d}" for i in range(N_TENANTS)]
    first = plan_membership_change(AffinityTable(members={}, homes=K, balance_factor=BALANCE_FACTOR), pods, tenants)
    table, current = first.table, first.assignment
    plain = load_imbalance(assign(AffinityTable(members=pods, homes=K), tenants), table)
    results = [_balance_result(f"{N_PODS} pods x {N_TENANTS} tenants", load_imbalance(current, table), plain)]
    results.append(_override_result(table))

    newcomer = "vllm-llama-70b-new"
    changes = {
        "join": (dict(pods, **{newcomer: 1.0}), lambda m: newcomer in m.gained),
        "leave": ({m: w for m, w in pods.items() if m != "vllm-llama-70b-0017"},
                  lambda m: "vllm-llama-70b-0017" in m.lost),
    }
    for label, (members, necessary) in changes.items():
        after = AffinityTable(members=members, homes=K)
        warm_s, cold_s, plain_s = _interleaved_best([
            lambda: plan_membership_change(table, members, tenants, current=current),
            lambda: plan_membership_change(table, members, tenants),
            lambda: assign(after, tenants),
        ], repeat)
        plan = plan_membership_change(table, members, tenants, current=current)
        minimum = sum(1 for m in plan.moves if necessary(m))
        for how, secs, bound in (("warm", warm_s, WARM_PLAN_RATIO), ("cold", cold_s, COLD_PLAN_RATIO)):
            results.append(Result(
                name=f"affinity plan {label} ({how}), {N_PODS} pods x {N_TENANTS} tenants",
                value=secs * 1e3, unit="ms", target=bound, direction="lower", kind="ratio",
                baseline=plain_s * 1e3, baseline_name="plain rendezvous top-k of the same fleet",
                note=f"moved {len(plan.moves)} tenants = {plan.movement_fraction:.4f} of {N_TENANTS}",
            ))
        results.append(Result(
            name=f"affinity tenants moved on {label} vs the plain-rendezvous minimum",
            value=len(plan.moves), unit="tenants", target=MOVEMENT_BOUND, direction="lower", kind="ratio",
            baseline=minimum, baseline_name=f"tenants that {'gained the newcomer' if label == 'join' else 'lost the departed pod'}",
            note=f"{len(plan.moves) - minimum} displaced by the caps; ideal k/n = "
                 f"{K / len(plan.table.members):.4f}, moved fraction {plan.movement_fraction:.4f}",
        ))
        results.append(_balance_result(f"after a {label}", load_imbalance(plan.assignment, plan.table), None,
                                       over_cap=plan.over_cap_tenants))

    design = {f"replica-{i:02d}": 1.0 for i in range(DESIGN_PODS)}
    design_tenants = [f"tenant-{i:04d}" for i in range(DESIGN_TENANTS)]
    plan = plan_membership_change(AffinityTable(members={}, homes=K, balance_factor=BALANCE_FACTOR), design,
                                  design_tenants)
    plain = load_imbalance(assign(AffinityTable(members=design, homes=K), design_tenants), plan.table)
    results.append(_balance_result(f"design fleet {DESIGN_PODS} replicas x {DESIGN_TENANTS} tenants",
                                   load_imbalance(plan.assignment, plan.table), plain))
    return results


def _interleaved_best(fns: list, repeat: int) -> list[float]:
    """Best wall time of each of `fns`, run in turns so machine noise hits all alike."""
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], best_of(fn, repeat=1))
    return best


def _balance_result(what: str, imbalance: float, plain: float | None, over_cap: int = 0) -> Result:
    note = f"bounded by balanceFactor {BALANCE_FACTOR}"
    if plain is not None:
        note += f"; plain rendezvous in the same run: {plain:.3f}"
    if over_cap:
        note += f"; {over_cap} tenants over a cap"
    return Result(
        name=f"affinity max/mean home load, {what}, k={K}", value=imbalance, unit="x",
        target=BALANCE_FACTOR, direction="lower", kind="absolute", note=note,
    )


def _override_result(table: AffinityTable) -> Result:
    size = len(table.to_json())
    return Result(
        name=f"affinity table JSON with home overrides, {N_PODS} pods x {N_TENANTS} tenants",
        value=size, unit="bytes", target=CONFIGMAP_BYTES, direction="lower", kind="absolute",
        note=f"{len(table.home_overrides)} overridden tenants "
             f"({len(table.home_overrides) / N_TENANTS:.2%}); the rest use plain rendezvous",
    )


if __name__ == "__main__":
    for r in run():
        base = f", baseline {r.baseline:.4g} ({r.baseline_name}), ratio {r.ratio:.3f}" if r.baseline else ""
        print(f"{'PASS' if r.passed else 'FAIL'}  {r.name}: {r.value:.4g} {r.unit}{base} "
              f"(target {r.target}) {r.note}")
