"""Warm-before-ready's first source (issue #24): before the rollout moves the partition
past a pod, the operator reads that pod's own sidecar (`rollout_snapshot`); once the
pod runs the new version its warm-up replays those prompts first, then the other
homes'. Against fakes of the apiserver, the sidecars' control API and the engine, so
the order of the calls and every object written can be checked: fast, no cluster."""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import kopf
import pytest

from kvtier import control_api as api
from kvtier.affinity import AffinityTable
from kvtier_operator import names, publish, rollout_snapshot
from kvtier_operator import rollout_warmup_io as io
from kvtier_operator.membership import Member
from kvtier_operator.rollout_reconcile import reconcile_rollout
from kvtier_operator.sidecar_client import FleetStats, MemberStats
from fake_http import OkResponse
from sidecar_fleet import tiny_policy

OLD, NEW = "sha256:" + "1" * 64, "sha256:" + "2" * 64
NS, POLICY, APP = "ns", "wllm", "wllm"
PODS = ("wllm-0", "wllm-1", "wllm-2")
BLOCK = 16


def ids(base: int, n: int = 2 * BLOCK) -> list[int]:
    """Token ids no other prompt shares a block with (base apart by 1,000)."""
    return list(range(base, base + n))


# What each pod's sidecar holds, per tenant: (token ids, frequency). wllm-2 (restarted
# by the first step) is acme's first home and one of beta's other homes.
OWN_ACME, OWN_BETA = ids(900_000), ids(901_000)
HOT = {
    "wllm-2": {"acme": [(OWN_ACME, 4.0)], "beta": [(OWN_BETA, 1.0)]},
    "wllm-0": {"acme": [(ids(100_000), 2.0)], "beta": [(ids(200_000), 5.0)]},
    "wllm-1": {"acme": [(ids(110_000), 1.0)], "beta": [(ids(210_000), 3.0)]},
}
TENANTS_OF = {t for held in HOT.values() for t in held}


def table() -> AffinityTable:
    return AffinityTable(epoch=1, members={p: 1.0 for p in PODS}, homes=3,
                         home_overrides={"acme": ["wllm-2", "wllm-0", "wllm-1"],
                                         "beta": ["wllm-0", "wllm-2", "wllm-1"]})


def pod(name: str, version: str, uid: str, gated: bool = False) -> dict[str, Any]:
    conditions = [] if gated else [{"type": "Ready", "status": "True"}]
    return {"metadata": {"name": name, "namespace": NS, "uid": uid, "labels": {"app": APP},
                         "annotations": {names.WEIGHTS_VERSION_ANNOTATION: version},
                         "ownerReferences": [{"kind": "StatefulSet", "name": APP}]},
            "spec": {"readinessGates": [{"conditionType": names.WARM_GATE}]},
            "status": {"phase": "Running", "podIP": f"10.0.0.{name[-1]}", "conditions": conditions,
                       "containerStatuses": [{"name": "engine", "ready": True}]}}


class Kube:
    """The apiserver calls the rollout and the warm-up make; every write recorded."""

    def __init__(self, pods: list[dict[str, Any]], body: dict[str, Any]) -> None:
        self.pods, self.body = pods, body
        self.writes: list[tuple[str, Any]] = []
        self.calls: list[str] = []
        members = {p: Member(p, f"10.0.0.{p[-1]}", 1.0, NS, POLICY) for p in PODS}
        self.config_map = publish.affinity_config_map(POLICY, NS, table(), members)

    async def read_stateful_set(self, namespace, name):
        return {"metadata": {"name": APP}, "spec": {
            "replicas": len(PODS), "selector": {"matchLabels": {"app": APP}},
            "updateStrategy": {"rollingUpdate": {"partition": 0}},
            "template": {"metadata": {"annotations": {names.WEIGHTS_VERSION_ANNOTATION: OLD}}}}}

    async def list_pods(self, namespace, selector):
        return self.pods

    async def read_config_map(self, namespace, name):
        return self.config_map if name == names.affinity_config_map(POLICY) else None

    async def read_policy(self, namespace, name):
        return self.body

    async def create_event_once(self, event):
        self.calls.append("event")
        self.writes.append(("event", event))

    async def patch_status(self, namespace, name, fields):
        self.calls.append("status")
        self.writes.append(("status", fields))

    async def patch_stateful_set(self, namespace, name, patch):
        self.calls.append("patch-partition")
        self.writes.append(("statefulset", patch))

    async def patch_pod_condition(self, namespace, name, uid, condition):
        self.calls.append("gate")
        self.writes.append(("pod-condition", condition))
        return True


class Sidecars:
    """The sidecars' control API: stats (tenants held) and hot lists, per pod."""

    def __init__(self, silent: set[str] = frozenset(), slow_s: float = 0.0, wrong_tenant: bool = False) -> None:
        self.silent, self.slow_s, self.wrong_tenant = silent, slow_s, wrong_tenant
        self.asked: list[tuple[str, str]] = []
        self.calls: list[str] = []
        self.stats_asked: list[str] = []

    async def fleet_stats(self, members):
        out = []
        for name in members:
            self.stats_asked.append(name)
            if name in self.silent:
                continue
            if self.slow_s:
                await asyncio.sleep(self.slow_s)
            out.append(MemberStats(name, 10, 5, 10, tuple(sorted(HOT.get(name, {})))))
        return FleetStats(tuple(out))

    async def hot(self, member, tenant, max_tokens, timeout_s=3.0):
        self.asked.append((member.name, tenant))
        self.calls.append(f"hot {member.name}")
        if member.name in self.silent:
            return None
        held = HOT.get(member.name, {}).get(tenant, [])
        # The real client refuses an answer naming another tenant; the ids are checked
        # per tenant below all the same.
        return api.HotPrompts(tenant=tenant, max_tokens=max_tokens, tokens=sum(len(t) for t, _ in held),
                              prefixes=[api.HotPrompt(token_ids=t, frequency=f) for t, f in held])


class Engine:
    """The new pod's engine: records each warm-up prompt (tenant, token ids)."""

    def __init__(self) -> None:
        self.prompts: list[tuple[str, tuple[int, ...]]] = []

    def post(self, url, json):
        self.prompts.append((json["cache_salt"], tuple(json["prompt"])))
        return OkResponse()


class _Policies:
    def lock(self, key):
        return asyncio.Lock()


def policy_body() -> dict[str, Any]:
    body = tiny_policy(POLICY, APP, workloadRef={"kind": "StatefulSet", "name": APP},
                       rollout={"canaryPods": 1, "steps": [50, 100],
                                "warmup": {"maxTokens": 4096, "timeout": "30s"}},
                       affinity={"homes": 3}, blockSize=BLOCK)
    body["spec"]["model"]["weightsVersion"] = NEW
    body["metadata"].update({"namespace": NS, "generation": 1})
    body["status"] = {"phase": "Ready", "version": OLD}
    return body


def memo_of(kube: Kube, sidecars: Sidecars, engine: Engine) -> kopf.Memo:
    memo = kopf.Memo()
    memo.kube, memo.sidecars, memo.http, memo.policies = kube, sidecars, engine, _Policies()
    return memo


def fleet(restarted: bool = False) -> list[dict[str, Any]]:
    """wllm-0..2 on the old version; `restarted`: wllm-2 back on the new one (a new uid),
    held out by its gate."""
    pods = [pod(n, OLD, f"old-{n}") for n in PODS]
    if restarted:
        pods[2] = pod("wllm-2", NEW, "new-wllm-2", gated=True)
    return pods


async def start_rollout(kube: Kube, sidecars: Sidecars, memo: kopf.Memo) -> None:
    """One rollout tick: the plan starts the rollout and patches the partition past wllm-2."""
    import functools

    plan = await reconcile_rollout(kube, sidecars, kube.body,
                                   snapshot=functools.partial(rollout_snapshot.before_patch, memo))
    assert plan is not None and plan.kind == "start" and plan.workload.partition == 2


async def warm(memo: kopf.Memo, body: dict[str, Any]) -> None:
    from kvtier import policy

    spec = policy.KVCachePolicySpec.model_validate(body["spec"])
    memo.kube.pods = fleet(restarted=True)
    await io._warm_pod(memo, body, spec, OLD, memo.kube.pods[2])


def test_the_restarted_pods_own_snapshot_is_read_before_the_partition_moves_and_replayed_first():
    body = policy_body()
    kube, sidecars, engine = Kube(fleet(), body), Sidecars(), Engine()
    memo = memo_of(kube, sidecars, engine)

    async def run() -> None:
        await start_rollout(kube, sidecars, memo)
        # Read before the patch restarted it: the pod's own sidecar, for its tenants.
        assert {("wllm-2", "acme"), ("wllm-2", "beta")} <= set(sidecars.asked)
        assert kube.calls.index("patch-partition") > 0 and all(
            c != "patch-partition" for c in kube.calls[:kube.calls.index("patch-partition")])
        snap = rollout_snapshot.store(memo)
        assert len(snap) == 1 and snap.has((NS, POLICY, "wllm-2", NEW), "old-wllm-2")
        sidecars.asked.clear()
        await warm(memo, body)

    asyncio.run(run())
    # The own prompts are replayed, ranked by the pod's own frequencies: acme's first
    # (frequency 4 beats wllm-0's 2, both at weight 1: wllm-2 is acme's first home), and
    # beta's before beta's other home's (1 at the own weight beats wllm-0's 5 at an
    # other home's 0.1: the own list is this pod's traffic, not discounted again).
    assert engine.prompts[0] == ("acme", tuple(OWN_ACME))
    beta = [tokens for tenant, tokens in engine.prompts if tenant == "beta"]
    assert beta[0] == tuple(OWN_BETA) and len(beta) == 2
    # Two sources a tenant in all: the snapshot, then one other home (never the restarted pod).
    assert len(sidecars.asked) == 2 and all(m != "wllm-2" for m, _ in sidecars.asked)
    gate = next(c for kind, c in kube.writes if kind == "pod-condition")
    assert gate["status"] == "True" and gate["reason"] == "Warmed"
    assert len(rollout_snapshot.store(memo)) == 0  # used once, then dropped


def test_without_a_snapshot_the_warm_up_reads_the_other_homes_at_once():
    # The operator restarted after the pod did (nothing in memory): today's sources.
    body = policy_body()
    kube, sidecars, engine = Kube(fleet(), body), Sidecars(), Engine()
    memo = memo_of(kube, sidecars, engine)
    started = time.monotonic()
    asyncio.run(warm(memo, body))
    assert time.monotonic() - started < 2.0
    assert engine.prompts and all(tokens[0] < 900_000 for _, tokens in engine.prompts)  # none of wllm-2's
    assert sorted(sidecars.asked) == [("wllm-0", "acme"), ("wllm-0", "beta"), ("wllm-1", "acme"), ("wllm-1", "beta")]
    gate = next(c for kind, c in kube.writes if kind == "pod-condition")
    assert gate["reason"] == "Warmed"


def test_no_snapshot_and_no_source_answering_releases_the_gate_as_failed():
    body = policy_body()
    kube, sidecars, engine = Kube(fleet(), body), Sidecars(silent={"wllm-0", "wllm-1"}), Engine()
    memo = memo_of(kube, sidecars, engine)
    asyncio.run(warm(memo, body))
    gate = next(c for kind, c in kube.writes if kind == "pod-condition")
    assert gate["reason"] == "WarmupFailed" and "sources:" in gate["message"] and not engine.prompts


@pytest.mark.parametrize("fault", ["silent", "slow"])
def test_a_sidecar_that_does_not_answer_costs_the_step_at_most_the_read_timeout(fault, monkeypatch):
    monkeypatch.setattr(rollout_snapshot, "READ_TIMEOUT_S", 0.2)
    body = policy_body()
    sidecars = Sidecars(silent={"wllm-2"}) if fault == "silent" else Sidecars(slow_s=5.0)
    kube, engine = Kube(fleet(), body), Engine()
    memo = memo_of(kube, sidecars, engine)

    async def run() -> float:
        t0 = time.monotonic()
        kept = await rollout_snapshot.before_patch(memo, body, _spec(body), _patch(), fleet())
        assert kept == 0
        return time.monotonic() - t0

    assert asyncio.run(run()) < 1.0
    held = rollout_snapshot.store(memo)
    assert held.tokens == 0
    # Not read on every tick: a silent sidecar's empty answer is kept (read once), a slow
    # one's read is cut and tried again, MAX_TRIES reads in all.
    for _ in range(3):
        assert asyncio.run(rollout_snapshot.before_patch(memo, body, _spec(body), _patch(), fleet())) == 0
    reads = sidecars.stats_asked.count("wllm-2")
    assert reads == (1 if fault == "silent" else rollout_snapshot.MAX_TRIES)
    sidecars.slow_s = 0.0
    asyncio.run(warm(memo, body))  # falls back to the other homes
    assert engine.prompts and all(tokens[0] < 900_000 for _, tokens in engine.prompts)


def _spec(body):
    from kvtier import policy

    return policy.KVCachePolicySpec.model_validate(body["spec"])


def _patch():
    from kvtier_operator.rollout import WorkloadPatch

    return WorkloadPatch(NEW, 2)


def _rolled_and_warmed() -> tuple[Kube, Engine]:
    """The rollout's first step started (snapshot read, partition patched) and the
    restarted pod warmed: the apiserver's writes and the engine's prompts."""
    body = policy_body()
    kube, sidecars, engine = Kube(fleet(), body), Sidecars(), Engine()
    memo = memo_of(kube, sidecars, engine)

    async def run() -> None:
        await start_rollout(kube, sidecars, memo)
        await warm(memo, body)

    asyncio.run(run())
    return kube, engine


def test_a_tenants_prompts_never_carry_another_tenants_token_ids():
    _, engine = _rolled_and_warmed()
    own = {tenant: {tuple(t) for pod_hot in HOT.values() for t, _ in pod_hot.get(tenant, [])}
           for tenant in TENANTS_OF}
    assert {t for t, _ in engine.prompts} == {"acme", "beta"}
    for tenant, tokens in engine.prompts:
        assert any(tokens == held[:len(tokens)] for held in own[tenant]), (tenant, tokens[:3])
        others = set().union(*(own[t] for t in TENANTS_OF if t != tenant))
        assert not any(tokens[:BLOCK] == held[:BLOCK] for held in others)
    snap = rollout_snapshot.Snapshots()
    snap.put((NS, POLICY, "wllm-2", NEW), rollout_snapshot.Snapshot("u", 0.0, {}))
    assert snap.get((NS, POLICY, "wllm-2", NEW), now=1.0) is not None


def test_nothing_of_the_snapshot_is_written_to_the_apiserver():
    kube, _ = _rolled_and_warmed()
    assert {kind for kind, _ in kube.writes} >= {"status", "event", "statefulset", "pod-condition"}
    written = json.dumps([w for _, w in kube.writes], default=str)
    # No run of the snapshot's token ids (any id of a held prompt) in any object written.
    for held in (OWN_ACME, OWN_BETA):
        assert not any(str(t) in written for t in held)


def test_the_snapshots_held_are_bounded_in_tokens_and_time():
    store = rollout_snapshot.Snapshots(max_tokens=100, ttl_s=10.0)
    from array import array

    def snap(n: int, taken: float = 0.0) -> rollout_snapshot.Snapshot:
        return rollout_snapshot.Snapshot("u", taken, {"acme": ((array("q", range(n)), 1.0),)})

    assert store.put(("a", "p", "x-0", NEW), snap(60)) and store.put(("a", "p", "x-1", NEW), snap(60))
    assert len(store) == 1 and store.tokens == 60  # the oldest went
    assert not store.put(("a", "p", "x-2", NEW), snap(101))  # alone over the bound: not kept
    assert store.get(("a", "p", "x-1", NEW), now=11.0) is None  # past its time
    assert store.tokens == 0
