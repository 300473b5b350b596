"""Scenarios on scaled-down fleets: thrash, rollout, membership."""
from kvtier.sim import scenarios


def test_under_thrash_kvtier_admission_keeps_at_least_twice_lrus_hit_rate():
    rep = scenarios.default_thrash(6_000)
    kv, lru = rep.result("kvtier cache"), rep.result("lru cache")
    assert kv.hit_rate >= 2 * lru.hit_rate
    assert kv.evictions < lru.evictions  # LRU does the eviction work for nothing


def test_a_rolling_rollout_adds_far_less_prefill_than_all_at_once_and_dips_less():
    rep = scenarios.default_rollout(27_000, n_replicas=4)
    figs = {f.name: f for f in rep.figures}
    rolling = next(f for name, f in figs.items() if name.startswith("peak excess prefill ratio, gradual, pods 30"))
    together = figs["peak excess prefill ratio, gradual, pods of a step together / all at once"]
    assert rolling.value < together.value <= 1.0
    assert rolling.value <= 0.5
    events = rep.result("gradual, pods 30 s apart").events
    assert [e["replicas"] for e in events] == [[0], [1], [2], [3]]  # canary, 10%, 50%, 100% of 4
    assert all("warmed_tokens" not in e for e in events)  # cold: no budget, no warm-up
    assert all(e["restart_warmed_blocks"] == 0 for e in events)  # back at once: no leaver's copies
    assert figs["hit-rate dip depth, all at once"].value > figs["hit-rate dip depth, gradual, pods 30 s apart"].value
    # Both warmed plans ran, each pod within its budget (prompt tokens, as the operator counts).
    same = rep.params["same_extra_prefill_tokens_per_pod"]
    for label, budget in ((f"gradual, pods 30 s apart, warmed before ready ({scenarios.WARM_BEFORE_READY_TOKENS:,} "
                           "tokens/pod)", scenarios.WARM_BEFORE_READY_TOKENS),
                          (f"gradual, pods 30 s apart, warmed before ready at the same extra prefill ({same:,} "
                           "tokens/pod)", same)):
        events = rep.result(label).events
        # Each step first reads its pods' own sidecars (the operator's snapshot), then restarts them.
        assert [e["replicas"] for e in events if e["kind"] == "snapshot"] == [[0], [1], [2, 3]]  # per step
        warmed = [e for e in events if e["kind"] == "version"]
        assert [e["replicas"] for e in warmed] == [[0], [1], [2], [3]]
        assert all(e["snapshots"] == 1 for e in warmed)
        assert all(0 <= e["warmed_prompt_tokens"] <= budget for e in warmed)
        assert any(e["warmed_tokens"] > 0 for e in warmed)
        # Before each restart, its tenants' next homes are warmed from it (a leaver), as
        # the operator does while the deleted pod's sidecar still answers.
        assert all(e["restart_warmed_blocks"] > 0 for e in warmed)
    before = rep.result(f"gradual, pods 30 s apart, warmed before ready at the same extra prefill, "
                        f"{scenarios.OTHER_HOMES_ONLY}").events
    assert all(e.get("snapshots") == 0 for e in before if e["kind"] == "version")


def test_a_negative_warm_up_budget_is_refused():
    import pytest

    from kvtier.sim.loop import SimConfig

    with pytest.raises(ValueError, match="warm_before_ready_tokens"):
        SimConfig(scenarios.design_workload(100), warm_before_ready_tokens=-1)


def test_a_join_moves_about_k_in_n_tenants_and_warm_up_halves_the_dip():
    rep = scenarios.membership(scenarios.design_workload(30_000, n_tenants=100, rate_rps=150.0),
                               scenarios.small_fleet(8, 40.0), join_at_s=100.0, leave_at_s=150.0)
    warm, cold = rep.result("kvtier with warm-up"), rep.result("kvtier without warm-up")
    join, leave = warm.events
    assert join["kind"] == "join" and 0.15 < join["movement_fraction"] < 0.5  # k/(n+1) = 3/9
    assert join["warmed_blocks"] > 0 and leave["warmed_blocks"] > 0
    assert cold.events[0]["warmed_blocks"] == 0
    dips = {f.name: f.value for f in rep.figures}
    for kind in ("join", "leave"):
        with_warm = dips[f"kvtier with warm-up: hit-rate dip after {kind}"]
        without = dips[f"kvtier without warm-up: hit-rate dip after {kind}"]
        assert without > 0.02  # moving tenants cold costs hits ...
        assert with_warm < 0.75 * without  # ... and warming their new first home wins most back
    assert warm.hit_rate > cold.hit_rate
