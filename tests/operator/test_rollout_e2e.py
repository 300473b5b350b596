"""The weights-version rollout against the real apiserver and controller-manager (the
StatefulSet controller moves pods by partition), with the real injected sidecars run
by the node agent and traffic sent through the real engine client. The operator runs
under KopfRunner with its ServiceAccount token, granted StatefulSet access by the Role
below (the rule the chart's ClusterRole needs for rollouts)."""
from __future__ import annotations

import numpy as np
import pytest

from kvtier.keys import KeyRoot
from kvtier_operator import names, rollout_handlers
from kvtier_sidecar.client import EngineHit, SidecarClient
from kvtier_testenv import engine_io
from kvtier_testenv.synthetic import prefill_kv
from kvtier_testenv.kubectl import Kubectl
from kvtier_testenv.ports import free_port
from operator_harness import (
    RunningOperator, events, operator_options, register_webhook, wait_for,
)
import sidecar_fleet
from sidecar_fleet import BLOCK_BYTES, BLOCK_SIZE, DIGEST as OLD, PROMPT_TOKENS, PodSidecar, tiny_policy
from test_operator_e2e import short_workdir, status_of

NEW = "sha256:" + "2" * 64
REPLICAS = 4
APP = "llm"
# Generous for a 2-core CI box: each step includes its pods' restarts.
RECOVER_WINDOW = "90s"
FAIL_WINDOW = "20s"
MIN_LOOKUPS = 40
ROLLOUT_TIMEOUT_S = 180


@pytest.fixture
def operator(namespace, operator_kubeconfig, control_plane, tmp_path, monkeypatch):
    admin = Kubectl(control_plane.kubeconfig)
    port = free_port()
    options = operator_options(tmp_path, port)
    hook = register_webhook(admin, namespace, open(options.webhook_cert, "rb").read(), port)
    op = RunningOperator(namespace, operator_kubeconfig, options, monkeypatch).start()
    yield op
    if op.runner is not None:
        op.stop()
    admin.delete("mutatingwebhookconfiguration", hook)


def stateful_set(version: str) -> dict:
    return sidecar_fleet.stateful_set(APP, REPLICAS, version=version)


def rollout_policy(window: str) -> dict:
    return tiny_policy("llm", APP, workloadRef={"kind": "StatefulSet", "name": APP}, rollout={
        "canaryPods": 1, "steps": [50, 100],
        "recovery": {"threshold": 0.5, "window": window, "minLookups": MIN_LOOKUPS}})


def root(version: str, tenant: str = "acme") -> KeyRoot:
    return KeyRoot(tenant, "reference-tiny", version, "fp16", "rope-default", "default")


def tokens(i: int) -> np.ndarray:
    return np.random.default_rng(1000 + i).integers(0, 30_000, PROMPT_TOKENS).astype(np.uint32)


def serve(sidecar: PodSidecar, version: str, prompts: range, repeats: int) -> None:
    """An engine's traffic: each prompt looked up and stored twice (admission wants two
    sightings), then looked up `repeats` more times (hits once stored)."""
    client = SidecarClient(sidecar.socket)
    try:
        for i in prompts:
            t = tokens(i)
            for _ in range(2):
                client.release(engine_io.request(client, root(version), t, BLOCK_BYTES)[0])
                client.store(root(version), t, prefill_kv(root(version), t, BLOCK_SIZE, BLOCK_BYTES))
            for _ in range(repeats):
                client.release(engine_io.request(client, root(version), t, BLOCK_BYTES)[0])
    finally:
        client.close()


def hits(sidecar: PodSidecar, version: str, i: int) -> bool:
    """One engine request for prompt i (looked up, a hit loaded, reported)."""
    client = SidecarClient(sidecar.socket)
    try:
        got, _ = engine_io.request(client, root(version), tokens(i), BLOCK_BYTES)
        client.release(got)
        return isinstance(got, EngineHit)
    finally:
        client.close()


def serves_right_kv(sidecar: PodSidecar, version: str, i: int) -> bool:
    """Prompt i hits under `version`'s root with exactly the KV that version computes
    (never another version's: the key root includes the weights version)."""
    client = SidecarClient(sidecar.socket)
    try:
        got = client.lookup(root(version), tokens(i))
        try:
            if not isinstance(got, EngineHit):
                return False
            dst = np.zeros(len(got.blocks) * BLOCK_BYTES, np.uint8)
            client.materialize(got, dst)
            want = prefill_kv(root(version), tokens(i), BLOCK_SIZE, BLOCK_BYTES)[: len(dst)]
            other = prefill_kv(root(OLD if version == NEW else NEW), tokens(i), BLOCK_SIZE, BLOCK_BYTES)[: len(dst)]
            assert not np.array_equal(want, other)
            return bool(np.array_equal(dst, want))
        finally:
            client.release(got)
    finally:
        client.close()


class Workload:
    def __init__(self, kubectl: Kubectl, agent):
        self.kubectl, self.agent = kubectl, agent

    def sts(self) -> dict:
        return self.kubectl.get_json("statefulset", APP)

    def pods(self) -> dict[str, dict]:
        items = self.kubectl.get_json("pods", "-l", f"app={APP}")["items"]
        return {p["metadata"]["name"]: p for p in items if not p["metadata"].get("deletionTimestamp")}

    def versions(self) -> dict[str, str | None]:
        return {n: (p["metadata"].get("annotations") or {}).get(names.WEIGHTS_VERSION_ANNOTATION)
                for n, p in self.pods().items()}

    def ready(self) -> None:
        try:
            self.agent.wait_ready(REPLICAS, selector=f"app={APP}", timeout_s=ROLLOUT_TIMEOUT_S)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\nsidecar logs: "
                                 f"{ {p: self.agent.log(self.kubectl.namespace, p)[-1500:] for p in self.pods()} }")

    def on(self, new: set[str]) -> dict:
        """Wait until exactly `new` pods run the new version, all ready; their sidecars."""
        want = {f"{APP}-{i}": NEW if f"{APP}-{i}" in new else OLD for i in range(REPLICAS)}
        wait_for(f"pods on {want}", lambda: self.versions() == want, timeout_s=ROLLOUT_TIMEOUT_S)
        self.ready()
        return {p: PodSidecar.of(self.agent, self.kubectl.namespace, p) for p in self.pods()}

    def fleet_hit_rate(self, pods: list[str]) -> float:
        stats = [PodSidecar.of(self.agent, self.kubectl.namespace, p).get("/cache/stats") for p in pods]
        return engine_io.hit_rate(stats)


def start_fleet(kubectl: Kubectl, agent, window: str) -> tuple[Workload, dict]:
    kubectl.apply(rollout_policy(window))
    wait_for("sidecar ConfigMap", lambda: kubectl.run(
        "get", "configmap", names.sidecar_config_map("llm"), check=False).returncode == 0)
    kubectl.apply(stateful_set(OLD))
    w = Workload(kubectl, agent)
    sidecars = w.on(set())
    for n, sc in sidecars.items():  # the old fleet's warm traffic: its hit rate is the baseline
        serve(sc, OLD, range(3), repeats=3)
    wait_for("the policy at rest on the old version",
             lambda: status_of(kubectl, "llm").get("version") == OLD and status_of(kubectl, "llm").get("phase") == "Ready")
    return w, sidecars


def rollout_status(kubectl: Kubectl) -> dict:
    return status_of(kubectl, "llm").get("rollout") or {}


def event_count(kubectl: Kubectl, reason: str) -> int:
    return sum(e.get("count") or 1 for e in events(kubectl, "llm", reason))


def test_rollout_walks_canary_and_steps_to_the_whole_fleet_and_resumes_after_a_restart(
        operator, kubectl, node_agent_factory):
    """Canary (1 pod) -> 50% -> 100%, each step advanced only once the new pods' hit rate
    recovered; history records each step; the new version's KV is never served under
    the old key root or vice versa; an operator restarted mid-step resumes at the same
    step without repeating its side effects."""
    w, old_sidecars = start_fleet(kubectl, node_agent_factory(workdir=short_workdir()), RECOVER_WINDOW)
    baseline = w.fleet_hit_rate(sorted(old_sidecars))
    kubectl.run("patch", "kvcp", "llm", "--type=merge", "-p",
                f'{{"spec": {{"model": {{"weightsVersion": "{NEW}"}}}}}}')

    # Step 1: the canary is the highest ordinal.
    sidecars = w.on({"llm-3"})
    status = wait_for("rollout step 1", lambda: (r := rollout_status(kubectl)).get("step") == 1 and r)
    assert status["targetVersion"] == NEW and status["baselineHitRate"] == baseline and status["canaryPercent"] == 25
    assert status["expectedColdPrefillTokensPerS"] > 0
    assert status_of(kubectl, "llm")["phase"] == "RollingOut" and status_of(kubectl, "llm")["version"] == OLD
    assert w.sts()["spec"]["updateStrategy"]["rollingUpdate"]["partition"] == 3
    started = event_count(kubectl, "RolloutStarted")
    assert started == 1

    # Never the wrong KV: old-version prompts (cached on llm-0) miss under the new root
    # on both versions' pods, and the old root still hits where it was cached.
    assert hits(sidecars["llm-0"], OLD, 0)
    assert not hits(sidecars["llm-0"], NEW, 0) and not hits(sidecars["llm-3"], NEW, 0)

    # Restart mid-step: the same step, the same clock, no second patch or Event.
    wait_for("the canary's misses observed", lambda: rollout_status(kubectl).get("currentHitRate") == 0.0)
    generation = w.sts()["metadata"]["generation"]
    operator.stop()
    operator.start()
    serve(sidecars["llm-3"], NEW, range(1), repeats=0)
    wait_for("a hit on the canary", lambda: hits(sidecars["llm-3"], NEW, 0), timeout_s=10)
    canary = sidecars["llm-3"].get("/cache/stats")
    seen = engine_io.hit_rate([canary])
    assert seen and canary["lookups"] < MIN_LOOKUPS  # a changed rate, still no recovery
    wait_for(f"the restarted operator's evaluation ({seen})", lambda: rollout_status(kubectl).get("currentHitRate") == seen)
    resumed = rollout_status(kubectl)
    assert resumed["step"] == 1 and resumed["stepStartedAt"] == status["stepStartedAt"]
    assert w.sts()["metadata"]["generation"] == generation
    assert event_count(kubectl, "RolloutStarted") == started

    # Recover the canary -> step 2 (50%): llm-2 joins the new version.
    serve(sidecars["llm-3"], NEW, range(4), repeats=8)
    sidecars = w.on({"llm-3", "llm-2"})
    wait_for("rollout step 2", lambda: rollout_status(kubectl).get("step") == 2)
    assert w.sts()["spec"]["updateStrategy"]["rollingUpdate"]["partition"] == 2
    serve(sidecars["llm-2"], NEW, range(4), repeats=8)

    # Step 3 (100%) -> completed.
    sidecars = w.on({"llm-3", "llm-2", "llm-1", "llm-0"})
    wait_for("rollout step 3", lambda: rollout_status(kubectl).get("step") == 3)
    for p in ("llm-1", "llm-0"):
        serve(sidecars[p], NEW, range(4), repeats=8)
    done = wait_for("rollout completed", lambda: (s := status_of(kubectl, "llm")).get("version") == NEW and s,
                    timeout_s=ROLLOUT_TIMEOUT_S)
    assert done["phase"] == "Ready"
    history = done["rollout"]["history"]
    assert [(h["step"], h["outcome"], h["version"]) for h in history] == [
        (1, "recovered", NEW), (2, "recovered", NEW), (3, "completed", NEW)]
    assert all(h["hitRate"] >= 0.5 * baseline for h in history)
    conds = {c["type"]: c for c in done["conditions"]}
    assert conds["RolloutProgressing"]["status"] == "False" and conds["RolloutProgressing"]["reason"] == "Completed"
    assert event_count(kubectl, "RolloutStep") == 2 and event_count(kubectl, "RolloutCompleted") == 1
    sts = w.sts()
    assert sts["spec"]["updateStrategy"]["rollingUpdate"]["partition"] == 0
    assert sts["spec"]["template"]["metadata"]["annotations"][names.WEIGHTS_VERSION_ANNOTATION] == NEW
    # The new version's prompts are served with the new version's KV.
    assert serves_right_kv(sidecars["llm-0"], NEW, 0) and serves_right_kv(sidecars["llm-3"], NEW, 3)


def test_rollout_that_never_recovers_is_rolled_back_with_the_numbers(operator, kubectl, node_agent_factory):
    """The canary's sidecar holds its prompts and offers a hit on every lookup, but its
    engine loads none of them (its own prefix cache holds them): the hit rate the gate
    reads stays at 0. After the window the operator restores the old template with
    partition 0, every pod runs the old version again, and the condition and Event say
    why with the numbers."""
    w, old_sidecars = start_fleet(kubectl, node_agent_factory(workdir=short_workdir()), FAIL_WINDOW)
    baseline = w.fleet_hit_rate(sorted(old_sidecars))
    kubectl.run("patch", "kvcp", "llm", "--type=merge", "-p",
                f'{{"spec": {{"model": {{"weightsVersion": "{NEW}"}}}}}}')
    sidecars = w.on({"llm-3"})
    client = SidecarClient(sidecars["llm-3"].socket)
    try:
        for i in range(3):  # the canary's sidecar holds the prompts (two sightings each)
            for _ in range(2):
                client.release(client.lookup(root(NEW), tokens(100 + i)))
                client.store(root(NEW), tokens(100 + i), prefill_kv(root(NEW), tokens(100 + i), BLOCK_SIZE,
                                                                     BLOCK_BYTES))
        for i in range(MIN_LOOKUPS + 4):  # offered every time, never loaded
            got, _ = engine_io.request(client, root(NEW), tokens(100 + i % 3), BLOCK_BYTES, load=False)
            assert got
            client.release(got)
    finally:
        client.close()
    canary = sidecars["llm-3"].get("/cache/stats")
    assert engine_io.offered_rate([canary]) > 0.5 and engine_io.hit_rate([canary]) == 0.0
    lookups = canary["lookups"]

    status = wait_for("rolled back", lambda: (s := status_of(kubectl, "llm")).get("phase") == "RolledBack" and s,
                      timeout_s=ROLLOUT_TIMEOUT_S)
    w.on(set())  # every pod back on the old version, ready
    sts = w.sts()
    assert sts["spec"]["updateStrategy"]["rollingUpdate"]["partition"] == 0
    assert sts["spec"]["template"]["metadata"]["annotations"][names.WEIGHTS_VERSION_ANNOTATION] == OLD
    assert status["version"] == OLD and status["rollout"]["baselineHitRate"] == baseline
    [record] = status["rollout"]["history"]
    assert (record["step"], record["outcome"], record["version"], record["hitRate"]) == (1, "rolledBack", NEW, 0.0)
    expected = (f"hit rate 0.0000 over {lookups} lookups did not reach 0.5 x baseline {baseline:.4f} = "
                f"{0.5 * baseline:.4f} (min {MIN_LOOKUPS} lookups) within {FAIL_WINDOW}")
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds["RolledBack"]["status"] == "True" and conds["RolledBack"]["reason"] == "HitRateNotRecovered"
    assert expected in conds["RolledBack"]["message"]
    [event] = events(kubectl, "llm", "RolledBack")
    assert event["type"] == "Warning" and expected in event["message"]
    # The rolled-back target is not retried by itself.
    assert rollout_status(kubectl)["targetVersion"] == NEW and event_count(kubectl, "RolloutStarted") == 1
    assert rollout_handlers.ROLLOUT_INTERVAL_S < 15  # the checks above spanned several ticks
