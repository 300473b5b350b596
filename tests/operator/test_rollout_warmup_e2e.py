"""Warm-before-ready against the real apiserver and controller-manager, the operator
(KopfRunner, its ServiceAccount bound to the chart's RBAC: pods/status patch) and the
real injected sidecars run by the node agent — which honours readiness gates as
kubelet does. Each pod's engine container is the test env's OpenAI-compatible front
(`kvtier_testenv.engine_front`), whose prefill goes through the pod's own sidecar, so a
warm-up really stores KV of the new version; or, for the faults, an engine that does
not listen or answers too slowly."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from kvtier_operator import names
from kvtier_operator import rollout_warmup as rw
from kvtier_sidecar.client import EngineHit, SidecarClient
from kvtier_testenv import engine_io
from kvtier_testenv.kubectl import Kubectl
from kvtier_testenv.podenv import is_ready
from kvtier_testenv.ports import free_port
from kvtier_testenv.synthetic import prefill_kv
from operator_harness import events, wait_for
import sidecar_fleet
from sidecar_fleet import BLOCK_BYTES, BLOCK_SIZE, DIGEST as OLD, MATCHED_TOKENS, PodSidecar, tiny_policy
from test_operator_e2e import short_workdir, status_of
from test_rollout_controls import plugin
from test_rollout_e2e import NEW, root, tokens

pytestmark = pytest.mark.k8s

APP = "wllm"
REPLICAS = 2
TENANTS = ("acme", "beta")
PROMPTS = 3  # per tenant: token ids tokens(i + offset) for each tenant
OFFSET = {"acme": 0, "beta": 50}
TIMEOUT_S = 180


def tenant_tokens(tenant: str, i: int) -> np.ndarray:
    return tokens(OFFSET[tenant] + i)


def stateful_set(version: str, port: int, engine: str = "front", delay_s: float = 0.0) -> dict:
    """`engine`: "front" (engine_front serving on `port`), or "absent" (a container the
    node agent does not run: shown running and ready, nothing listens)."""
    if engine == "front":
        container = {"name": "engine", "image": "engine:1",
                     "command": [sys.executable, "-m", "kvtier_testenv.engine_front", "--port", str(port),
                                 "--block-bytes", str(BLOCK_BYTES), "--delay-s", str(delay_s)],
                     "env": [{"name": names.POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                     "readinessProbe": {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 1}}
    else:
        container = sidecar_fleet.SLEEPING_ENGINE
    return sidecar_fleet.stateful_set(APP, REPLICAS, container, version=version)


def warm_policy(warmup: dict | None, **spec) -> dict:
    rollout = {"canaryPods": 1, "steps": [50, 100],
               "recovery": {"threshold": 0.5, "window": "10m", "minLookups": 40}}
    if warmup is not None:
        rollout["warmup"] = warmup
    # Every pod a home of every tenant: the canary serves (and is warmed for) both.
    return tiny_policy("wllm", APP, workloadRef={"kind": "StatefulSet", "name": APP}, rollout=rollout,
                       affinity={"homes": REPLICAS}, **spec)


class Fleet:
    def __init__(self, kubectl: Kubectl, agent):
        self.kubectl, self.agent = kubectl, agent

    def pods(self) -> dict[str, dict]:
        items = self.kubectl.get_json("pods", "-l", f"app={APP}")["items"]
        return {p["metadata"]["name"]: p for p in items if not p["metadata"].get("deletionTimestamp")}

    def pod(self, name: str) -> dict | None:
        return self.pods().get(name)

    def versions(self) -> dict[str, str | None]:
        return {n: rw.pod_version(p) for n, p in self.pods().items()}

    def sidecar(self, name: str) -> PodSidecar:
        try:
            return PodSidecar.of(self.agent, self.kubectl.namespace, name)
        except KeyError:
            return PodSidecar.of(self.agent, self.kubectl.namespace, name, names.SIDECAR_CONTAINER)

    def ready(self) -> list[dict]:
        return self.agent.wait_ready(REPLICAS, selector=f"app={APP}", timeout_s=TIMEOUT_S)


def start(kubectl: Kubectl, agent, warmup: dict | None, port: int, policy_spec: dict | None = None,
          **sts) -> Fleet:
    kubectl.apply(warm_policy(warmup, **(policy_spec or {})))
    wait_for("sidecar ConfigMap", lambda: kubectl.run(
        "get", "configmap", names.sidecar_config_map("wllm"), check=False).returncode == 0)
    kubectl.apply(stateful_set(OLD, port, **sts))
    fleet = Fleet(kubectl, agent)
    fleet.ready()
    for n in fleet.pods():  # the old fleet's traffic: both tenants' prompts, hit often
        sc = fleet.sidecar(n)
        for tenant in TENANTS:
            serve_tenant(sc, tenant, OLD)
    wait_for("the policy at rest on the old version",
             lambda: (s := status_of(kubectl, "wllm")).get("version") == OLD and s.get("phase") == "Ready")
    return fleet


def serve_tenant(sc: PodSidecar, tenant: str, version: str) -> None:
    client = SidecarClient(sc.socket)
    r = root(version, tenant)
    try:
        for i in range(PROMPTS):
            t = tenant_tokens(tenant, i)
            for _ in range(2):
                client.release(engine_io.request(client, r, t, BLOCK_BYTES)[0])
                client.store(r, t, prefill_kv(r, t, BLOCK_SIZE, BLOCK_BYTES))
            for _ in range(3):
                client.release(engine_io.request(client, r, t, BLOCK_BYTES)[0])
    finally:
        client.close()


def first_request_hits_with_recomputed_kv(sc: PodSidecar, tenant: str, i: int, version: str) -> bool:
    """The first engine request for the prompt on this pod: a hit of the whole cached
    prefix, loaded bytes equal to what `version`'s weights compute."""
    client = SidecarClient(sc.socket)
    try:
        t = tenant_tokens(tenant, i)
        hit, loaded = engine_io.request(client, root(version, tenant), t, BLOCK_BYTES)
        try:
            if not isinstance(hit, EngineHit) or hit.matched_tokens != MATCHED_TOKENS:
                return False
            want = prefill_kv(root(version, tenant), t, BLOCK_SIZE, BLOCK_BYTES)[: len(loaded)]
            other = prefill_kv(root(OLD, tenant), t, BLOCK_SIZE, BLOCK_BYTES)[: len(loaded)]
            assert not np.array_equal(want, other)
            return bool(np.array_equal(loaded, want))
        finally:
            client.release(hit)
    finally:
        client.close()


def gate(pod: dict | None) -> dict | None:
    return rw.gate_condition(pod) if pod else None


def warmups(kubectl: Kubectl) -> dict[str, dict]:
    return {w["pod"]: w for w in (status_of(kubectl, "wllm").get("rollout") or {}).get("warmups") or []}


def roll_out(kubectl: Kubectl) -> None:
    kubectl.run("patch", "kvcp", "wllm", "--type=merge", "-p",
                f'{{"spec": {{"model": {{"weightsVersion": "{NEW}"}}}}}}')


def canary_on_new(fleet: Fleet) -> dict:
    canary = f"{APP}-{REPLICAS - 1}"
    return wait_for(f"{canary} on the new version", lambda: (p := fleet.pod(canary)) is not None
                    and rw.pod_version(p) == NEW and p, timeout_s=TIMEOUT_S)


def test_a_new_version_pod_is_held_out_until_warmed_then_serves_its_tenants_hottest_prefixes_as_hits(
        operator, kubectl, node_agent_factory):
    port = free_port()
    agent = node_agent_factory(workdir=short_workdir(), containers=("kvtier-sidecar", "engine"))
    # Each completion takes a while, so the gated pod is seen not Ready with its containers up.
    fleet = start(kubectl, agent, {"maxTokens": 4096, "timeout": "90s", "enginePort": port}, port, delay_s=2.0)
    # First creation: every pod's gate released at once, NotRolledOut.
    for p in fleet.pods().values():
        assert [g["conditionType"] for g in p["spec"]["readinessGates"]] == [names.WARM_GATE]
        assert (gate(p)["status"], gate(p)["reason"]) == ("True", rw.NOT_ROLLED_OUT)

    roll_out(kubectl)
    canary = canary_on_new(fleet)["metadata"]["name"]
    seen_gated = wait_for("the canary up but held out by its gate", lambda: (
        (p := fleet.pod(canary)) is not None and rw.pod_version(p) == NEW and rw.containers_up(p)
        and (gate(p) or {}).get("status") != "True" and p), timeout_s=TIMEOUT_S)
    assert not is_ready(seen_gated)
    released = wait_for("the canary's gate released", lambda: (
        (p := fleet.pod(canary)) is not None and (gate(p) or {}).get("status") == "True" and p), timeout_s=TIMEOUT_S)
    assert gate(released)["reason"] == rw.WARMED, gate(released)
    fleet.ready()  # the gate True: the node agent makes the pod Ready

    # Status: what was warmed, per pod.
    record = wait_for("the warm-up record", lambda: warmups(kubectl).get(canary))
    whole = MATCHED_TOKENS  # each prompt's whole blocks
    assert (record["outcome"], record["version"], record["tenants"], record["coldTenants"]) == (
        rw.WARMED, NEW, len(TENANTS), 0)
    assert (record["prompts"], record["tokens"], record["budgetTokens"]) == (
        len(TENANTS) * PROMPTS, len(TENANTS) * PROMPTS * whole, 4096)
    assert record["seconds"] > 0
    assert f"{record['tokens']} prompt tokens" in gate(released)["message"]
    [event] = events(kubectl, "wllm", "PodWarmed")
    assert canary in event["message"]
    [started] = events(kubectl, "wllm", "RolloutStarted")
    assert "warm-before-ready: each new pod prefills up to 4,096 prompt tokens" in started["message"]
    # What on-call sees: the plugin's status names the pod's warm-up.
    shown = plugin(kubectl, "status", "wllm")
    assert shown.returncode == 0, shown.stderr
    assert (f"warm {canary:<20} Warmed          {record['tokens']}/4096 tokens, {len(TENANTS)} tenants warm, 0 cold"
            in shown.stdout), shown.stdout

    # The warm-up's requests were marked (kv_transfer_params) and counted apart: before
    # any traffic the new pod has no traffic lookup and no prompt token in its hit
    # figure (what the alarm, the recovery check and the first minute read), only
    # warm-up lookups, which missed (it was cold).
    sc = fleet.sidecar(canary)
    before = sc.get("/cache/stats")
    assert (before["lookups"], before["hits"], before["engine"]["prompt_tokens"]) == (0, 0, 0), before
    warm_lookups = before["sidecar"].get("warmup_lookups", 0)
    assert warm_lookups >= len(TENANTS) * PROMPTS, before["sidecar"]
    assert before["sidecar"].get("warmup_tokens_miss", 0) > 0, before["sidecar"]

    # The warmed pod's first requests for its tenants' prompts are hits of the NEW
    # version's KV (bytes equal to a recompute), each tenant under its own root only.
    for tenant in TENANTS:
        for i in range(PROMPTS):
            assert first_request_hits_with_recomputed_kv(sc, tenant, i, NEW), (tenant, i)
    after = sc.get("/cache/stats")  # traffic counts as traffic; the warm-up's counters stay
    assert (after["lookups"], after["hits"]) == (len(TENANTS) * PROMPTS, len(TENANTS) * PROMPTS), after
    assert after["sidecar"]["warmup_lookups"] == warm_lookups
    client = SidecarClient(sc.socket)
    try:  # beta's token ids were warmed for beta, never under acme's key root
        miss = client.lookup(root(NEW, "acme"), tenant_tokens("beta", 0))
        assert not isinstance(miss, EngineHit)
        client.release(miss)
    finally:
        client.close()


def test_an_unreachable_engine_releases_the_gate_as_failed_and_the_rollout_goes_on(
        operator, kubectl, node_agent_factory):
    port = free_port()
    fleet = start(kubectl, node_agent_factory(workdir=short_workdir()), {"maxTokens": 4096, "enginePort": port},
                  port, engine="absent")
    roll_out(kubectl)
    canary = canary_on_new(fleet)["metadata"]["name"]
    released = wait_for("the canary's gate released", lambda: (
        (p := fleet.pod(canary)) is not None and (gate(p) or {}).get("status") == "True" and p), timeout_s=TIMEOUT_S)
    assert gate(released)["reason"] == rw.FAILED and "engine:" in gate(released)["message"]
    fleet.ready()
    record = wait_for("the warm-up record", lambda: warmups(kubectl).get(canary))
    assert (record["outcome"], record["tokens"], record["prompts"], record["coldTenants"]) == (
        rw.FAILED, 0, 0, len(TENANTS))
    [event] = events(kubectl, "wllm", "PodWarmupFailed")
    assert event["type"] == "Warning"
    # The rollout goes on with the pod cold: it serves, and the step judges it as ever.
    status = status_of(kubectl, "wllm")
    assert status["phase"] == "RollingOut" and status["rollout"]["step"] == 1
    serve_tenant(fleet.sidecar(canary), "acme", NEW)
    assert first_request_hits_with_recomputed_kv(fleet.sidecar(canary), "acme", 0, NEW)


def test_a_slow_engine_runs_out_of_time_and_the_gate_is_released_as_timed_out(
        operator, kubectl, node_agent_factory):
    port = free_port()
    agent = node_agent_factory(workdir=short_workdir(), containers=("kvtier-sidecar", "engine"))
    fleet = start(kubectl, agent, {"maxTokens": 4096, "timeout": "3s", "enginePort": port}, port, delay_s=2.0)
    roll_out(kubectl)
    canary = canary_on_new(fleet)["metadata"]["name"]
    released = wait_for("the canary's gate released", lambda: (
        (p := fleet.pod(canary)) is not None and (gate(p) or {}).get("status") == "True" and p), timeout_s=TIMEOUT_S)
    assert gate(released)["reason"] == rw.TIMED_OUT, gate(released)
    fleet.ready()
    record = wait_for("the warm-up record", lambda: warmups(kubectl).get(canary))
    assert record["outcome"] == rw.TIMED_OUT
    # Cut short: fewer prompts than the budget allowed were prefilled.
    assert record["prompts"] < len(TENANTS) * PROMPTS


def test_without_a_warmup_or_with_a_zero_budget_pods_have_no_gate(operator, kubectl, node_agent_factory):
    port = free_port()
    agent = node_agent_factory(workdir=short_workdir())
    for warmup in (None, {"maxTokens": 0}):
        kubectl.apply(warm_policy(warmup))
        wait_for("sidecar ConfigMap", lambda: kubectl.run(
            "get", "configmap", names.sidecar_config_map("wllm"), check=False).returncode == 0)
        kubectl.apply(stateful_set(OLD, port, engine="absent"))
        fleet = Fleet(kubectl, agent)
        for p in fleet.ready():
            assert not p["spec"].get("readinessGates") and gate(p) is None
            assert p["metadata"]["annotations"][names.INJECTED_ANNOTATION] == "wllm"
        kubectl.run("delete", "statefulset", APP, "--wait=true")
        wait_for("the pods gone", lambda: not fleet.pods())


def held_out_canary(fleet) -> str:
    """The canary's name once it runs the new version with its containers up and its
    gate still closed (mid-warm-up)."""
    canary = canary_on_new(fleet)["metadata"]["name"]
    wait_for("the canary up and held out", lambda: (
        (p := fleet.pod(canary)) is not None and rw.pod_version(p) == NEW and rw.containers_up(p)
        and (gate(p) or {}).get("status") != "True"), timeout_s=TIMEOUT_S)
    return canary


def test_policy_deleted_mid_warm_up_releases_the_gate(operator, kubectl, node_agent_factory):
    port = free_port()
    agent = node_agent_factory(workdir=short_workdir(), containers=("kvtier-sidecar", "engine"))
    fleet = start(kubectl, agent, {"maxTokens": 4096, "timeout": "10m", "enginePort": port}, port, delay_s=30.0)
    roll_out(kubectl)
    canary = held_out_canary(fleet)
    kubectl.run("delete", "kvcp", "wllm", "--wait=false")
    # The teardown returns the workload to the old version; whatever pod is there, none
    # stays gated: every pod ends Ready.
    wait_for("the policy gone", lambda: kubectl.run("get", "kvcp", "wllm", check=False).returncode != 0,
             timeout_s=TIMEOUT_S)
    for p in fleet.ready():
        g = gate(p)
        assert g is None or g["status"] == "True"


def test_an_operator_restarted_mid_warm_up_warms_the_pod_again_and_releases_it(
        operator, kubectl, node_agent_factory):
    port = free_port()
    agent = node_agent_factory(workdir=short_workdir(), containers=("kvtier-sidecar", "engine"))
    fleet = start(kubectl, agent, {"maxTokens": 4096, "timeout": "2m", "enginePort": port}, port, delay_s=5.0)
    roll_out(kubectl)
    canary = held_out_canary(fleet)
    operator.stop()  # mid-warm-up: its task goes with it, the gate stays closed
    held = fleet.pod(canary)
    assert (gate(held) or {}).get("status") != "True" and not is_ready(held)
    uid = held["metadata"]["uid"]
    operator.start()
    released = wait_for("the canary's gate released by the restarted operator", lambda: (
        (p := fleet.pod(canary)) is not None and (gate(p) or {}).get("status") == "True" and p), timeout_s=TIMEOUT_S)
    assert released["metadata"]["uid"] == uid and gate(released)["reason"] == rw.WARMED
    record = wait_for("the warm-up record", lambda: warmups(kubectl).get(canary))
    assert record["prompts"] == len(TENANTS) * PROMPTS and record["tenants"] == len(TENANTS)
    fleet.ready()
    sc = fleet.sidecar(canary)
    assert all(first_request_hits_with_recomputed_kv(sc, t, i, NEW) for t in TENANTS for i in range(PROMPTS))


def test_a_rollback_never_waits_for_a_warm_up(operator, kubectl, node_agent_factory):
    port = free_port()
    agent = node_agent_factory(workdir=short_workdir(), containers=("kvtier-sidecar", "engine"))
    fleet = start(kubectl, agent, {"maxTokens": 4096, "timeout": "10m", "enginePort": port}, port, delay_s=30.0)
    roll_out(kubectl)
    canary = held_out_canary(fleet)
    aborted = plugin(kubectl, "rollout", "abort", "wllm")
    assert aborted.returncode == 0, aborted.stderr
    # Rolled back long before the 10-minute warm-up deadline: every pod on the old
    # version and Ready, the gate of the one the rollback recreated released at once.
    wait_for("every pod back on the old version", lambda: fleet.versions() == {
        f"{APP}-{i}": OLD for i in range(REPLICAS)}, timeout_s=TIMEOUT_S)
    for p in fleet.ready():
        assert gate(p)["status"] == "True" and gate(p)["reason"] == rw.NOT_ROLLED_OUT, gate(p)
    assert canary not in warmups(kubectl)  # cancelled: no outcome recorded for it


def test_the_other_homes_sidecars_gone_the_canary_warms_from_its_own_snapshot(
        operator, kubectl, node_agent_factory):
    # The canary's own sidecar was read before the partition moved past it (issue #24):
    # its tenants' prompts come from there, whatever its other homes answer. (No source
    # at all, no snapshot: WarmupFailed, in test_rollout_own_snapshot.)
    import signal

    port = free_port()
    agent = node_agent_factory(workdir=short_workdir(), containers=("kvtier-sidecar", "engine"))
    fleet = start(kubectl, agent, {"maxTokens": 4096, "timeout": "60s", "enginePort": port}, port)
    old_pod = f"{APP}-0"
    agent.kill(kubectl.namespace, old_pod, names.SIDECAR_CONTAINER, sig=signal.SIGSTOP)  # the other home, frozen
    try:
        roll_out(kubectl)
        canary = canary_on_new(fleet)["metadata"]["name"]
        released = wait_for("the canary's gate released", lambda: (
            (p := fleet.pod(canary)) is not None and (gate(p) or {}).get("status") == "True" and p),
            timeout_s=TIMEOUT_S)
        assert gate(released)["reason"] == rw.WARMED, gate(released)
        record = wait_for("the warm-up record", lambda: warmups(kubectl).get(canary))
        assert (record["outcome"], record["prompts"], record["coldTenants"]) == (
            rw.WARMED, len(TENANTS) * PROMPTS, 0)
        wait_for("the canary Ready", lambda: is_ready(fleet.pod(canary) or {}), timeout_s=TIMEOUT_S)
    finally:
        agent.kill(kubectl.namespace, old_pod, names.SIDECAR_CONTAINER, sig=signal.SIGCONT)


def test_an_engine_answering_errors_releases_the_gate_as_failed_with_its_answer(
        operator, kubectl, node_agent_factory):
    port = free_port()
    agent = node_agent_factory(workdir=short_workdir(), containers=("kvtier-sidecar", "engine"))
    # A served model name the engine does not serve: every completion is a 404.
    fleet = start(kubectl, agent, {"maxTokens": 4096, "enginePort": port, "servedModelName": "not-served"}, port)
    roll_out(kubectl)
    canary = canary_on_new(fleet)["metadata"]["name"]
    released = wait_for("the canary's gate released", lambda: (
        (p := fleet.pod(canary)) is not None and (gate(p) or {}).get("status") == "True" and p), timeout_s=TIMEOUT_S)
    assert gate(released)["reason"] == rw.FAILED, gate(released)
    assert "engine: HTTP 404" in gate(released)["message"] and "not-served" in gate(released)["message"]
    record = wait_for("the warm-up record", lambda: warmups(kubectl).get(canary))
    assert (record["outcome"], record["prompts"], record["tokens"], record["coldTenants"]) == (
        rw.FAILED, 0, 0, len(TENANTS))
    fleet.ready()


# The new pods' first minute, shortened: the window a test waits out.
FIRST_MINUTE_S = 10
# A slow engine by the capacity estimate: 1e-5 TFLOPS on the tiny model's 1e6 params is
# 5 prefill tokens/s, so a 90s warm-up may prefill 5 x 90 x 0.5 = 225 tokens, not 4,096.
SLOW_HARDWARE = {"hardware": {"denseTflopsPerGpu": 1e-5}}
CAPACITY_TOKENS = 225


@pytest.mark.parametrize("operator", [{"first_minute_s": FIRST_MINUTE_S}], indirect=True, ids=["short-minute"])
def test_the_capacity_estimate_caps_the_budget_and_the_history_records_the_first_minute_hit_rate(
        operator, kubectl, node_agent_factory):
    from kvtier.policy import FirstMinute
    from kvtier_operator import first_minute

    port = free_port()
    agent = node_agent_factory(workdir=short_workdir(), containers=("kvtier-sidecar", "engine"))
    fleet = start(kubectl, agent, {"maxTokens": 4096, "timeout": "90s", "enginePort": port}, port,
                  policy_spec=SLOW_HARDWARE)
    roll_out(kubectl)
    canary = canary_on_new(fleet)["metadata"]["name"]
    released = wait_for("the canary's gate released", lambda: (
        (p := fleet.pod(canary)) is not None and (gate(p) or {}).get("status") == "True" and p), timeout_s=TIMEOUT_S)
    assert gate(released)["reason"] == rw.WARMED, gate(released)

    # Budget: what the estimate allows, not maxTokens. Each tenant's even share (113,
    # 112) fits one 64-token prefix; the 97 they leave fits one more: 3 prefixes.
    record = wait_for("the warm-up record", lambda: warmups(kubectl).get(canary))
    assert (record["budgetTokens"], record["capacityTokens"], record["prompts"], record["tokens"]) == (
        CAPACITY_TOKENS, CAPACITY_TOKENS, 3, 3 * MATCHED_TOKENS), record
    stated = (f"each new pod prefills up to {CAPACITY_TOKENS} prompt tokens of its tenants' hottest prefixes within "
              f"90s before it takes traffic (capacity estimate {CAPACITY_TOKENS} = 5 prefill tokens/s x 90s x 0.5, "
              f"under policy maxTokens 4,096)")
    [started] = events(kubectl, "wllm", "RolloutStarted")
    assert stated in started["message"], started["message"]

    # The canary's first minute: its window opens once it serves, from its counters then.
    fleet.ready()
    wait_for("the canary's first-minute window open", lambda: canary in {
        w["pod"] for w in (status_of(kubectl, "wllm").get("rollout") or {}).get("firstMinutePods") or []},
        timeout_s=TIMEOUT_S)
    sc = fleet.sidecar(canary)
    client = SidecarClient(sc.socket)
    try:  # every prompt of both tenants once: the 3 warmed ones hit (64 of 72 tokens), the others miss
        outcomes = []
        for tenant in TENANTS:
            for i in range(PROMPTS):
                hit, _ = engine_io.request(client, root(NEW, tenant), tenant_tokens(tenant, i), BLOCK_BYTES)
                outcomes.append(isinstance(hit, EngineHit))
                client.release(hit)
    finally:
        client.close()
    assert sum(outcomes) == 3, outcomes
    figure = wait_for("step 1's first-minute figure", lambda: (
        (status_of(kubectl, "wllm").get("rollout") or {}).get("firstMinutes") or [None])[0], timeout_s=TIMEOUT_S)
    status = status_of(kubectl, "wllm")
    prompt = len(TENANTS) * PROMPTS * len(tenant_tokens("acme", 0))
    assert (figure["step"], figure["pods"], figure["warmPods"], figure["coldPods"], figure["podNames"]) == (
        1, 1, 1, 0, [canary])
    assert (figure["lookups"], figure["promptTokens"], figure["loadedTokens"]) == (
        len(TENANTS) * PROMPTS, prompt, 3 * MATCHED_TOKENS)
    assert figure["hitRate"] == figure["warmHitRate"] == round(3 * MATCHED_TOKENS / prompt, 4)
    assert (figure["baselineHitRate"], figure["baselineSource"]) == (status["rollout"]["baselineHitRate"], "oldPods")
    assert figure["windowS"] == FIRST_MINUTE_S and status["phase"] == "RollingOut" and status["rollout"]["step"] == 1
    [event] = events(kubectl, "wllm", "RolloutFirstMinute")
    expected = first_minute.text(FirstMinute.model_validate(figure))
    assert event["message"] == expected and "1 warm, 0 cold" in expected

    # Enough traffic for the step to recover (>= 40 lookups): its history entry and
    # Event carry the figure.
    for tenant in TENANTS + TENANTS:
        serve_tenant(sc, tenant, NEW)
    step = wait_for("step 1 recorded", lambda: next((h for h in (status_of(kubectl, "wllm").get("rollout") or {})
                                                    .get("history") or [] if h["step"] == 1), None), timeout_s=TIMEOUT_S)
    assert step["outcome"] == "recovered" and step["firstMinute"]["hitRate"] == figure["hitRate"], step
    assert "podNames" not in step["firstMinute"] or not step["firstMinute"]["podNames"]
    assert expected in step["message"]
    [moved] = [e for e in events(kubectl, "wllm", "RolloutStep") if "step 1 recovered" in e["message"]]
    assert expected in moved["message"]
    shown = kubectl.run("get", "kvcp", "wllm", "-o", "yaml").stdout
    assert "firstMinute:" in shown and "firstMinutes:" in shown
