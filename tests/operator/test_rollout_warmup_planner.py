"""Warm-before-ready's pure part (`rollout_warmup`): which gated pods are warmed or
released, which tenants a pod serves and where their prefixes come from, how a pod's
token budget is spent across its tenants, what the gate says; and the webhook's gate, the policy's
bounds and the step message's budget."""
from __future__ import annotations

import pytest

from fake_http import OkResponse
from kvtier import policy
from kvtier.affinity import AffinityTable
from kvtier_operator import injection, names
from kvtier_operator import rollout_warmup as rw
from kvtier_operator.rollout import Observed, Workload, plan
from sidecar_fleet import tiny_policy

OLD, NEW = "sha256:" + "1" * 64, "sha256:" + "2" * 64


def pod(version: str | None = NEW, gated: bool = True, gate: str | None = None, up: bool = True,
        deleting: bool = False) -> dict:
    meta = {"name": "llm-3", "uid": "u3", "annotations": {names.WEIGHTS_VERSION_ANNOTATION: version} if version else {}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    conditions = [{"type": names.WARM_GATE, "status": gate}] if gate else []
    return {"metadata": meta,
            "spec": {"readinessGates": [{"conditionType": names.WARM_GATE}] if gated else []},
            "status": {"phase": "Running" if up else "Pending", "podIP": "10.0.0.3" if up else None,
                       "conditions": conditions,
                       "containerStatuses": [{"name": "engine", "ready": up}, {"name": "kvtier-sidecar", "ready": up}]}}


def decide(p: dict, warms: bool = True, in_flight: bool = True, target: str | None = NEW, old: str | None = OLD):
    return rw.decide(p, warms=warms, in_flight=in_flight, target=target, old=old)


def test_a_moved_pod_is_warmed_once_up_and_every_other_gated_pod_released_at_once():
    assert decide(pod()).kind == "warm"
    assert decide(pod(up=False)).kind == "wait"
    # Not gated, already released, or going away: nothing to do.
    assert decide(pod(gated=False)).kind == "none"
    assert decide(pod(gate="True")).kind == "none"
    assert decide(pod(deleting=True)).kind == "none"
    # A closed gate ("False") is warmed like a missing condition.
    assert decide(pod(gate="False")).kind == "warm"
    # First creation / no rollout / a pod on the old version / a rollback: released.
    for d in (decide(pod(), in_flight=False), decide(pod(version=OLD)), decide(pod(version=None)),
              decide(pod(), target=None), decide(pod(), target=NEW, old=NEW)):
        assert (d.kind, d.reason) == ("release", rw.NOT_ROLLED_OUT)
    assert (decide(pod(), warms=False).kind, decide(pod(), warms=False).reason) == ("release", rw.WARMUP_OFF)
    # Never stuck: a pod whose containers are not up is still released when not moved.
    assert decide(pod(up=False), in_flight=False).kind == "release"


def test_the_gates_condition_is_always_true_and_the_outcome_names_how():
    c = rw.condition(rw.TIMED_OUT, "x" * 2000, "2026-01-01T00:00:00Z")
    assert (c["type"], c["status"], c["reason"], len(c["message"])) == (names.WARM_GATE, "True", rw.TIMED_OUT, 1024)
    assert rw.outcome(rw.Tally(tokens=64, prompts=1)) == rw.WARMED
    assert rw.outcome(rw.Tally()) == rw.WARMED  # nothing to warm: warm as it can be
    assert rw.outcome(rw.Tally(failed_prompts=3)) == rw.FAILED
    assert rw.outcome(rw.Tally(prompts=2, failed_prompts=1)) == rw.WARMED
    assert rw.outcome(rw.Tally(prompts=2, timed_out=True)) == rw.TIMED_OUT
    assert rw.outcome(rw.Tally(source_error="none answered")) == rw.FAILED
    assert rw.outcome(rw.Tally(prompts=1, source_error="no source answered for tenant b")) == rw.WARMED
    text = rw.message(rw.Tally(tokens=128, prompts=2, tenants=1, cold_tenants=1, failed_prompts=1,
                               engine_error="HTTP 500 boom"), rw.WARMED, 1000, 1.25)
    assert text == ("Warmed: 128 prompt tokens (2 prompts) of 1000 prefilled for 1 tenants in 1.2s; 1 tenants "
                    "cold; 1 prompts failed (engine: HTTP 500 boom)")


def table(members: list[str], homes: int = 2) -> AffinityTable:
    return AffinityTable(epoch=1, members={m: 1.0 for m in members}, homes=homes)


def test_a_pods_tenants_are_those_whose_homes_include_it_once_it_serves():
    t = table(["llm-0", "llm-1", "llm-2"])  # llm-3 left the table while gated
    tenants = [f"t{i}" for i in range(40)]
    mine = rw.tenants_of_pod(t, "llm-3", 1.0, tenants)
    joined = table(["llm-0", "llm-1", "llm-2", "llm-3"])
    assert mine == sorted(x for x in tenants if "llm-3" in joined.homes_for(x))
    assert 0 < len(mine) < len(tenants)
    assert rw.tenants_of_pod(None, "llm-3", 1.0, tenants) == []
    assert rw.tenants_of_pod(table(["llm-0"], homes=4), "llm-3", 1.0, ["a", "b"]) == ["a", "b"]


def test_sources_are_the_tenants_old_homes_first_never_the_pod_or_another_version():
    t = table(["llm-0", "llm-1", "llm-2", "llm-3"])
    homes = t.homes_for("acme")
    old = ["llm-0", "llm-1", "llm-2"]
    got = rw.sources(t, "acme", "llm-3", old, holders=["llm-0", "llm-1", "llm-2", "llm-3"])
    assert "llm-3" not in got and set(got) == set(old)
    assert got[: len([h for h in homes if h in old])] == [h for h in homes if h in old]
    # A holder on the new version (not in old) is never a source; no holders: only homes.
    assert rw.sources(t, "acme", "llm-3", ["llm-0"], holders=["llm-1"]) == [h for h in homes if h == "llm-0"]
    assert rw.sources(None, "acme", "llm-3", ["llm-0", "llm-1"], holders=["llm-1"]) == ["llm-1"]
    # Pods already on the new version come last, and only when they hold the tenant
    # (the fleet's last old pod has no old peer left to read from).
    assert rw.sources(t, "acme", "llm-0", [], holders=["llm-2", "llm-3", "llm-0"],
                      new_members=["llm-1", "llm-2", "llm-3"]) == sorted(
        ["llm-2", "llm-3"], key=lambda m: t.order_for("acme").index(m))
    assert rw.sources(t, "acme", "llm-3", ["llm-0"], holders=["llm-0", "llm-1"], new_members=["llm-1"]) == [
        "llm-0", "llm-1"]


P = rw.Prompt


def test_rank_merges_sources_and_orders_by_frequency_times_length():
    a = [P((1, 2, 3, 4), 1.0), P((5, 6), 3.0), P((9,), 0.5)]
    b = [P((5, 6), 4.0), P((7, 8, 9, 10, 11, 12), 1.0), P((), 99.0)]
    ranked = rw.rank([a, b])
    assert [p.tokens for p in ranked] == [(5, 6), (7, 8, 9, 10, 11, 12), (1, 2, 3, 4), (9,)]
    assert ranked[0].frequency == 4.0  # the same ids once, the highest frequency seen
    # Ties: longer first, then by ids (deterministic).
    assert [p.tokens for p in rw.rank([[P((1, 1), 1.0), P((2,), 2.0), P((0, 0), 1.0)]])] == [(0, 0), (1, 1), (2,)]


def planned(plan: list[rw.Planned]) -> list[tuple]:
    return [(x.tenant, x.prompt.tokens, x.new_tokens, x.after) for x in plan]


def test_the_budget_goes_to_the_best_prompts_of_all_tenants_shared_prefixes_charged_once():
    other = rw.OTHER_HOME_WEIGHT
    assert other == 0.1
    candidates = {"a": (1.0, [P((1, 2, 3, 4, 6, 7), 1.0), P((1, 2, 3, 4, 5), 1.0)]),  # savings 6, 5
                  "b": (other, [P((1, 2, 3, 4, 5), 3.0)]),  # 0.1 x 3 x 5 = 1.5: the pod is not b's first home
                  "c": (1.0, [P((8, 8, 8), 1.0)])}  # 3
    # a's second prompt shares 4 tokens with its first: charged 1, replayed after it.
    # b's same ids are another tenant's (another cache_salt): charged whole.
    assert planned(rw.plan(candidates, 100)) == [
        ("a", (1, 2, 3, 4, 6, 7), 6, None), ("c", (8, 8, 8), 3, None), ("b", (1, 2, 3, 4, 5), 5, None),
        ("a", (1, 2, 3, 4, 5), 1, 0)]
    # 10 tokens: 6 + 3 leave 1, which b's 5 do not fit and a's shared prompt does.
    assert planned(rw.plan(candidates, 10)) == [
        ("a", (1, 2, 3, 4, 6, 7), 6, None), ("c", (8, 8, 8), 3, None), ("a", (1, 2, 3, 4, 5), 1, 0)]
    # A prefix of a chosen prompt adds nothing: not replayed; a prompt twice, once.
    assert planned(rw.plan({"a": (1.0, [P((1, 2, 3), 5.0), P((1, 2, 3, 4), 1.0), P((1, 2, 3, 4), 1.0)])}, 10)) == [
        ("a", (1, 2, 3), 3, None), ("a", (1, 2, 3, 4), 1, 0)]
    # Blocks of 4: a's prompts share one whole block (1, 2, 3, 4); blocks of 3: one
    # (1, 2, 3), the 4 is computed again and charged.
    assert planned(rw.plan(candidates, 100, block=4)) == planned(rw.plan(candidates, 100))
    assert planned(rw.plan(candidates, 100, block=3)) == [
        ("a", (1, 2, 3, 4, 6, 7), 6, None), ("c", (8, 8, 8), 3, None), ("a", (1, 2, 3, 4, 5), 2, 0),
        ("b", (1, 2, 3, 4, 5), 5, None)]
    assert planned(rw.plan(candidates, 100, block=8)) == [  # nothing whole shared: charged whole
        ("a", (1, 2, 3, 4, 6, 7), 6, None), ("a", (1, 2, 3, 4, 5), 5, None), ("c", (8, 8, 8), 3, None),
        ("b", (1, 2, 3, 4, 5), 5, None)]
    assert rw.plan(candidates, 0) == [] and rw.plan({}, 100) == [] and rw.plan({"a": (1.0, [])}, 5) == []
    for budget in range(0, 20):
        got = rw.plan(candidates, budget)
        assert sum(x.new_tokens for x in got) <= budget
        assert len({(x.tenant, x.prompt.tokens) for x in got}) == len(got)
        assert all(x.after is None or x.after < i and got[x.after].tenant == x.tenant for i, x in enumerate(got))


def test_a_pod_home_to_many_tenants_still_warms_whole_templates_first_homes_first():
    # The design notes' fleet: a pod is a home of ~136 tenants, and 65,536 / 136 = 482
    # tokens is under one 1,500-token template. Each source is asked for 8,192 tokens
    # (not 964, which returned nothing), and the budget buys 43 whole templates, those
    # of the tenants whose first home the pod is before any other's.
    assert rw.ask_tokens(65_536, 136) == rw.ASK_FLOOR_TOKENS == 8_192
    template = lambda t: tuple(range(t * 10_000, t * 10_000 + 1_500))  # noqa: E731
    candidates = {f"t{t:03d}": (1.0 if t % 3 == 0 else rw.OTHER_HOME_WEIGHT, [P(template(t), 1.0 + t / 1000)])
                  for t in range(136)}
    got = rw.plan(candidates, 65_536)
    assert len(got) == 43 and sum(x.new_tokens for x in got) == 43 * 1_500
    first = [f"t{t:03d}" for t in range(135, -1, -1) if t % 3 == 0]  # 46 first-home tenants, hottest first
    assert [x.tenant for x in got] == first[:43]


def test_a_tenant_weighs_fully_where_the_pod_is_its_first_home():
    t = table(["llm-0", "llm-1", "llm-2"])  # llm-3 left the table while gated
    joined = table(["llm-0", "llm-1", "llm-2", "llm-3"])
    tenants = [f"t{i}" for i in range(40)]
    weights = rw.home_weights(t, "llm-3", 1.0, tenants)
    assert set(weights) == set(rw.tenants_of_pod(t, "llm-3", 1.0, tenants))
    for tenant, w in weights.items():
        assert w == (1.0 if joined.homes_for(tenant)[0] == "llm-3" else rw.OTHER_HOME_WEIGHT)
    assert 1.0 in weights.values() and rw.OTHER_HOME_WEIGHT in weights.values()
    assert rw.home_weights(None, "llm-3", 1.0, tenants) == {}


def spec(**rollout) -> policy.KVCachePolicySpec:
    body = tiny_policy("llm", "llm", workloadRef={"kind": "StatefulSet", "name": "llm"}, rollout=rollout)
    return policy.KVCachePolicySpec.model_validate(body["spec"])


def serving_pod() -> dict:
    return {"metadata": {"name": "p", "labels": {"app": "llm"}},
            "spec": {"containers": [{"name": "engine", "image": "e"}],
                     "readinessGates": [{"conditionType": "example.com/other"}]}}


def test_the_webhook_adds_the_gate_only_when_a_warm_up_is_configured():
    with_gate = injection.inject(serving_pod(), "llm", spec(warmup={}), injection.SidecarImage())
    assert with_gate["spec"]["readinessGates"] == [{"conditionType": "example.com/other"},
                                                   {"conditionType": names.WARM_GATE}]
    for off in (spec(), spec(warmup={"maxTokens": 0})):
        patch = injection.inject(serving_pod(), "llm", off, injection.SidecarImage())
        assert "readinessGates" not in patch["spec"]
    no_workload = spec(warmup={}).model_copy(update={"workload_ref": None})
    assert "readinessGates" not in injection.inject(serving_pod(), "llm", no_workload, injection.SidecarImage())["spec"]


@pytest.mark.parametrize("warmup, message", [
    ({"maxTokens": -1}, "greater than or equal to 0"),
    ({"maxTokens": policy.MAX_ROLLOUT_WARM_TOKENS + 1}, "less than or equal to"),
    ({"timeout": "0s"}, "rollout.warmup.timeout must be between 1s and 1h"),
    ({"timeout": "2h"}, "rollout.warmup.timeout must be between 1s and 1h"),
    ({"timeout": "soon"}, "should match pattern"),
    ({"enginePort": 0}, "greater than or equal to 1"),
])
def test_absurd_warm_up_settings_are_refused_by_the_model(warmup, message):
    with pytest.raises(ValueError) as err:
        spec(warmup=warmup)
    assert message in str(err.value)


def test_the_step_message_states_the_warm_up_budget():
    from datetime import datetime, timezone

    observed = Observed(Workload(4, OLD, 0), (), datetime(2026, 1, 1, tzinfo=timezone.utc), 1000.0)
    started = plan(spec(warmup={"maxTokens": 5000, "timeout": "90s"}).rollout, NEW, OLD, None, "Ready", observed)
    assert started.kind == "start"
    assert ("warm-before-ready: each new pod prefills up to 5,000 prompt tokens of its tenants' hottest prefixes "
            "within 90s before it takes traffic") in started.event[2]
    cold = plan(spec().rollout, NEW, OLD, None, "Ready", observed)
    assert "warm-before-ready" not in cold.event[2]


def test_a_policy_being_deleted_gives_new_pods_no_gate():
    from kvtier_operator import admission_policies

    raw = tiny_policy("llm", "llm", workloadRef={"kind": "StatefulSet", "name": "llm"},
                      rollout={"canaryPods": 1, "warmup": {"maxTokens": 100}})["spec"]
    live = admission_policies.entry("llm", raw, {"creationTimestamp": "t"})
    deleting = admission_policies.entry("llm", raw, {"creationTimestamp": "t", "deletionTimestamp": "u"})
    assert live[1]["rollout"]["warmup"] == {"maxTokens": 100} and raw["rollout"]["warmup"] == {"maxTokens": 100}
    assert "warmup" not in deleting[1]["rollout"] and deleting[1]["rollout"]["canaryPods"] == 1
    for e, gated in ((live, True), (deleting, False)):
        patch = injection.inject(serving_pod(), "llm", policy.KVCachePolicySpec.model_validate(e[1]),
                                 injection.SidecarImage())
        assert any(g["conditionType"] == names.WARM_GATE for g in patch["spec"].get("readinessGates", [])) == gated


def test_sources_are_asked_for_twice_a_share_at_least_one_long_prompt_within_the_budget():
    assert rw.ask_tokens(4096, 2) == 4096 and rw.ask_tokens(100_000, 2) == 100_000
    assert rw.ask_tokens(65_536, 8) == 16_384 and rw.ask_tokens(65_536, 136) == 8_192
    assert rw.ask_tokens(10, 3) == 10 and rw.ask_tokens(20_000, 100) == 8_192
    assert rw.ask_tokens(0, 3) == 0 and rw.ask_tokens(100, 0) == 0


def test_a_steps_history_and_event_sum_up_the_warm_ups_of_its_rollout():
    from datetime import datetime, timezone

    from kvtier_operator.rollout import PodSample

    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    s = spec(warmup={}, recovery={"minLookups": 1, "threshold": 0.5})
    warm = [policy.PodWarmup(pod="llm-3", version=NEW, outcome="Warmed", tokens=384, budget_tokens=4096,
                             finished_at=now),
            policy.PodWarmup(pod="llm-9", version=OLD, outcome="Warmed", tokens=999, finished_at=now),  # another rollout
            policy.PodWarmup(pod="llm-2", version=NEW, outcome="WarmupTimedOut", tokens=16, budget_tokens=4096,
                             finished_at=now)]
    status = policy.RolloutStatus(target_version=NEW, step=1, baseline_hit_rate=0.5, step_started_at=now,
                                  warmups=warm)
    pods = (PodSample("llm-3", NEW, True, 10, 90, 100), PodSample("llm-0", OLD, True, 10, 50, 100))
    advanced = plan(s.rollout, NEW, OLD, status, "RollingOut", Observed(Workload(4, NEW, 3), pods, now, 1000.0))
    assert advanced.kind == "advance"
    summary = ("warm-before-ready so far: 1 pods warmed, 0 failed, 1 timed out, 400 prompt tokens prefilled of "
               "8,192 budgeted")
    assert summary in advanced.rollout.history[-1].message and summary in advanced.event[2]
    assert advanced.rollout.warmups == warm  # kept for the steps to come
    bare = plan(s.rollout, NEW, OLD, status.model_copy(update={"warmups": []}), "RollingOut",
                Observed(Workload(4, NEW, 3), pods, now, 1000.0))
    assert "warm-before-ready so far" not in bare.rollout.history[-1].message


def test_the_budget_is_maxtokens_capped_by_what_the_engine_prefills_within_half_its_deadline():
    # 1,000 tokens/s x 120s x 0.5 = 60,000 < 65,536: the estimate binds.
    capped = rw.budget(65536, 120, 1000.0)
    assert (capped.tokens, capped.max_tokens, capped.capacity_tokens, capped.by_capacity) == (60000, 65536, 60000, True)
    assert rw.budget_text(capped, 120) == ("capacity estimate 60,000 = 1,000 prefill tokens/s x 120s x 0.5, "
                                           "under policy maxTokens 65,536")
    # 1,000 x 90 x 0.5 = 45,000 >= 4,096: the policy's figure stands.
    within = rw.budget(4096, 90, 1000.0)
    assert (within.tokens, within.capacity_tokens, within.by_capacity) == (4096, 45000, False)
    assert rw.budget_text(within, 90) == ("policy maxTokens 4,096, within the capacity estimate 45,000 = "
                                          "1,000 prefill tokens/s x 90s x 0.5")
    # No estimate: maxTokens as written; a zero budget stays zero (warm-up off).
    none = rw.budget(4096, 90, 0.0)
    assert (none.tokens, none.capacity_tokens) == (4096, None)
    assert rw.budget_text(none, 90) == "policy maxTokens 4,096; no capacity estimate"
    assert rw.budget(0, 90, 1000.0).tokens == 0
    assert rw.budget(100, 1, 33.3).tokens == 16  # floor(33.3 x 1 x 0.5)


def test_the_step_message_states_the_budget_the_capacity_estimate_allows():
    from datetime import datetime, timezone

    observed = Observed(Workload(4, OLD, 0), (), datetime(2026, 1, 1, tzinfo=timezone.utc), 100.0)
    started = plan(spec(warmup={"maxTokens": 65536, "timeout": "2m"}).rollout, NEW, OLD, None, "Ready", observed)
    assert ("warm-before-ready: each new pod prefills up to 6,000 prompt tokens of its tenants' hottest prefixes "
            "within 2m before it takes traffic (capacity estimate 6,000 = 100 prefill tokens/s x 120s x 0.5, "
            "under policy maxTokens 65,536)") in started.event[2]


def test_a_zero_budget_is_todays_behaviour_and_the_bounds_are_stated_in_the_crd():
    assert not spec(warmup={"maxTokens": 0}).rollout.warms and spec(warmup={}).rollout.warms
    from kvtier import crd

    schema = crd.openapi_schema()
    tokens = schema["properties"]["spec"]["properties"]["rollout"]["properties"]["warmup"]["properties"]["maxTokens"]
    assert (tokens["minimum"], tokens["maximum"]) == (0, policy.MAX_ROLLOUT_WARM_TOKENS)


def test_a_warmup_request_is_marked_as_the_warmup_and_prefill_sends_exactly_that():
    """Every prompt the warm-up replays carries the marker (`kv_transfer_params`) that the
    connector and the reference engine read, so its lookup is counted apart from traffic."""
    import asyncio

    from kvtier import names as core_names
    from kvtier_operator import rollout_warmup_io as io

    body = io.warmup_request("llm", "acme", (5, 6, 7))
    assert body == {"model": "llm", "prompt": [5, 6, 7], "max_tokens": 1, "cache_salt": "acme",
                    "kv_transfer_params": {"kvtier": {"purpose": "warmup"}}}
    assert core_names.is_warmup(body[core_names.KV_TRANSFER_PARAMS_FIELD])
    assert not core_names.is_warmup(None) and not core_names.is_warmup({"kvtier": "warmup"})

    sent = []

    class Http:
        def post(self, url, json):
            sent.append((url, json))
            return OkResponse()

    progress = io._Progress()
    ok = asyncio.run(io._prefill(Http(), "http://10.0.0.3:8000/v1/completions", "llm", "acme",
                                 rw.Prompt((5, 6, 7), 1.0), progress))
    assert ok and sent == [("http://10.0.0.3:8000/v1/completions", body)]


def test_a_canary_also_warms_the_tenants_it_gains_when_the_step_removes_a_stable_pod_by_their_chance():
    """A Deployment pair's step adds a canary pod, then the ReplicaSet controller removes
    one stable pod of its choosing: each tenant of that pod may land on the canary,
    which only its own warm-up can fill (the old homes hold the old version's blocks).
    The weight is OTHER_HOME_WEIGHT x the share of stable pods whose removal makes the
    canary a home: counted here by removing each one in turn."""
    stable = ["llm-0", "llm-1", "llm-2", "llm-3"]
    t = table(stable, homes=2)
    canary = "llm-canary-x"
    tenants = [f"t{i}" for i in range(60)]
    sure = rw.home_weights(t, canary, 1.0, tenants)
    weights = rw.home_weights(t, canary, 1.0, tenants, leaving=1, removable=stable)
    assert set(rw.tenants_of_pod(t, canary, 1.0, tenants, 1, stable)) == set(weights)
    gained = 0
    for tenant in tenants:
        after = [table([m for m in stable if m != gone] + [canary], homes=2).homes_for(tenant) for gone in stable]
        share = sum(canary in homes for homes in after) / len(stable)
        if tenant in sure:
            assert weights[tenant] == sure[tenant] and share == 1.0
        elif share:
            gained += 1
            assert weights[tenant] == pytest.approx(rw.OTHER_HOME_WEIGHT * share), tenant
        else:
            assert tenant not in weights
    assert gained and sure, "the names should give both kinds of tenant"
    # A StatefulSet's pods restart in place (nothing leaves), and a step that removes no
    # one adds nothing either.
    assert rw.home_weights(t, canary, 1.0, tenants, leaving=0, removable=stable) == sure
    assert rw.home_weights(t, canary, 1.0, tenants, leaving=1, removable=()) == sure
