"""Warm-before-ready in the simulator: the operator's plan, budgets, tenants, the dip."""
import random

import numpy as np
import pytest

from kvtier import warmup_plan
from kvtier.sim import loop, scenarios
from kvtier.sim.loop import Event, SimConfig, Simulation, simulate
from kvtier.sim.workload import generate
from kvtier_operator import rollout_warmup as rw

RESTART_S = 60.0


def _spec(n=6_000):
    # 40 tenants at 60 rps on 4 replicas: a pod is a home of ~30 tenants, first home of ~10.
    return scenarios.design_workload(n, n_tenants=40, rate_rps=60.0)


def _fleet():
    return scenarios.small_fleet(4, 60.0)


def _restart(snapshot=True):
    """Pod 0 restarts at RESTART_S; with `snapshot` its own hot list is read just before
    (the operator reads it when it moves the partition past the pod)."""
    return ([Event(RESTART_S - 1.0, "snapshot", (0,))] if snapshot else []) + [
        Event(RESTART_S, "version", (0,), version=1)]


def _run(budget, source="homes", n=6_000, events=None):
    spec = _spec(n)
    events = events if events is not None else _restart()
    cfg = SimConfig(spec, _fleet(), block_tokens=256, warm_before_ready_tokens=budget, warm_source=source)
    sim = Simulation(cfg, events, workload=generate(spec))
    return sim, sim.run()


def test_the_plan_is_the_operators_on_the_same_prompts():
    rnd = random.Random(7)
    assert loop.WARM_OTHER_HOME_WEIGHT == rw.OTHER_HOME_WEIGHT
    assert loop.WARM_ASK_FLOOR_TOKENS == rw.ASK_FLOOR_TOKENS
    for _ in range(200):
        tenants = [f"t{i}" for i in range(rnd.randint(1, 6))]
        # Few distinct ids and short prompts: prompts often share a prefix.
        answers = {t: [[(tuple(rnd.randrange(3) for _ in range(rnd.randint(1, 5))), rnd.choice([0.5, 1.0, 2.0]))
                        for _ in range(rnd.randint(0, 6))] for _ in range(rnd.randint(1, 2))] for t in tenants}
        weights = {t: rnd.choice([1.0, loop.WARM_OTHER_HOME_WEIGHT]) for t in tenants}
        budget = rnd.choice([0, 3, 7, 20, 100])
        ours = {t: loop.warm_rank([[loop.WarmPrompt(tok, f) for tok, f in a] for a in answers[t]]) for t in tenants}
        theirs = {t: rw.rank([[rw.Prompt(tok, f) for tok, f in a] for a in answers[t]]) for t in tenants}
        assert {t: [(p.tokens, p.frequency) for p in ps] for t, ps in ours.items()} == \
            {t: [(p.tokens, p.frequency) for p in ps] for t, ps in theirs.items()}
        block = rnd.choice([1, 2, 3])
        a = loop.warm_plan({t: (weights[t], ours[t]) for t in tenants}, budget, block)
        b = rw.plan({t: (weights[t], theirs[t]) for t in tenants}, budget, block)
        assert [(x.tenant, x.prompt.tokens, x.new_tokens, x.after) for x in a] == \
            [(x.tenant, x.prompt.tokens, x.new_tokens, x.after) for x in b]
        assert sum(x.new_tokens for x in b) <= budget
        assert loop.warm_ask(budget, len(tenants)) == rw.ask_tokens(budget, len(tenants))
    for budget, n in ((65_536, 136), (65_536, 2), (1_000_000, 10), (6_553, 14), (0, 5)):
        assert loop.warm_ask(budget, n) == rw.ask_tokens(budget, n)


def test_a_budget_of_zero_is_the_cold_restart():
    spec = _spec()
    events = [Event(RESTART_S, "version", (0,), version=1)]
    w = generate(spec)
    cold = simulate(SimConfig(spec, _fleet(), block_tokens=256), events, workload=w)
    zero = simulate(SimConfig(spec, _fleet(), block_tokens=256, warm_before_ready_tokens=0), events, workload=w)
    assert zero.matched_tokens == cold.matched_tokens and zero.evictions == cold.evictions
    assert "warmed_tokens" not in zero.events[0] and zero.events[0]["ready_s"] == {0: RESTART_S}


def test_the_warm_up_stays_within_the_budget_and_gates_the_pod_until_it_is_prefilled():
    sim, res = _run(65_536)
    ev = next(e for e in res.events if e["kind"] == "version")
    assert 0 < ev["warmed_prompt_tokens"] <= 65_536
    # Charged as the operator counts (a shared prefix's whole blocks once): what the
    # engine prefills.
    assert 0 < ev["warmed_tokens"] == ev["warmed_prompt_tokens"]
    # Held out of traffic for at least its prefill time (behind what its queue held), then ready.
    assert ev["ready_s"][0] >= RESTART_S + ev["warmed_tokens"] / sim.cfg.fleet.prefill_tokens_per_s
    assert not sim.fleet.gated(0)
    with pytest.raises(ValueError, match="warm_source"):
        SimConfig(_spec(10), warm_source="elsewhere")


@pytest.mark.parametrize("source", ["homes", "own"])
def test_the_warm_up_never_crosses_tenants(source, monkeypatch):
    spec = _spec(4_500)
    w = generate(spec)
    replayed = []
    real = loop.warm_plan

    def spy(candidates, budget, block=1):
        order = real(candidates, budget, block)
        replayed.extend((x.tenant, x.prompt) for x in order)
        return order

    monkeypatch.setattr(loop, "warm_plan", spy)
    cfg = SimConfig(spec, _fleet(), block_tokens=256, warm_before_ready_tokens=200_000, warm_source=source)
    sim = Simulation(cfg, _restart(), workload=w)
    res = sim.run()
    assert res.events[1]["snapshots"] == (1 if source == "own" else 0)
    assert replayed
    homes_of_pod = {t for t in sim.roots.tenant_names if sim.fleet.names[0] in sim.policy.table.homes_for(t)}
    names = sim.roots.tenant_names
    for tenant, prompt in replayed:
        assert tenant in homes_of_pod
        t = names.index(tenant)
        tokens = np.asarray(prompt.tokens)
        # Every warmed prompt starts with one of ITS tenant's own templates (prompts of
        # no other tenant share a first block with them).
        own = [np.array_equal(tokens[:len(tpl)], tpl[:len(tokens)]) for tpl in
               (w._template_tokens(t, k) for k in range(spec.templates_per_tenant))]
        assert any(own), (tenant, tokens[:4])


def test_trimming_keeps_the_prefix_prompts_share_and_leaves_a_lone_prompt_whole():
    P = loop.WarmPrompt
    template = tuple(range(8))
    answers = [[P(template + (100, 101), 3.0), P(template + (200, 201, 202, 203), 2.0)], [P((50, 51, 52), 1.0)]]
    trimmed = warmup_plan.cut_to_shared(answers, block=4)
    assert [p.tokens for p in trimmed[0]] == [template, template]  # one template, replayed once after rank
    assert [p.tokens for p in trimmed[1]] == [(50, 51, 52)]
    assert [p.tokens for p in loop.warm_rank(trimmed)] == [template, (50, 51, 52)]


def test_the_restarted_pods_own_snapshot_wins_back_its_first_minute_and_a_missing_one_falls_back():
    # The pod's own tenants (it is their first home) send it their traffic, and affinity
    # routing kept their prefixes on it alone: its other homes have little to give. Read
    # from the pod itself before it restarts (the operator's snapshot), the warm-up
    # brings its first minute up towards the run without a restart.
    spec = _spec(7_200)
    w = generate(spec)

    def first_minute(events=None, **kw):
        cfg = SimConfig(spec, _fleet(), block_tokens=256, **kw)
        res = simulate(cfg, events if events is not None else _restart(), workload=w)
        return next(e for e in res.events if e["kind"] == "version")["first_minute_hit_rate"][0]

    steady = simulate(SimConfig(spec, _fleet(), block_tokens=256), [], workload=w).hit_rate
    cold = first_minute()
    own = first_minute(warm_before_ready_tokens=200_000)
    homes = first_minute(warm_before_ready_tokens=200_000, warm_source="homes")
    missing = first_minute(_restart(snapshot=False), warm_before_ready_tokens=200_000)
    assert cold < steady
    assert own > cold and own > homes
    assert steady - own < 0.5 * (steady - cold)  # most of the first minute won back
    assert missing == homes  # no snapshot: the other homes, as before
