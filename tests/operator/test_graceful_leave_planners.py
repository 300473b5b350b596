"""Graceful leave without a cluster: who is a leaving candidate, the warm plan that
sources from a leaver with a surviving fallback, and the grace period injection gives."""
from __future__ import annotations

import pytest
import yaml

from kvtier import policy
from kvtier.affinity import TenantMove
from kvtier_operator import injection, membership, warmup
from operator_cases import EXAMPLES_DIR

SELECTOR = policy.LabelSelector(match_labels={"app": "llm"})
DELETED = "2025-01-01T00:00:00Z"


def view(name: str, ready: bool = True, ip: str | None = "10.0.0.9", deleting: bool = False,
         app: str = "llm") -> membership.PodView:
    meta = {"name": name, "labels": {"app": app}, **({"deletionTimestamp": DELETED} if deleting else {})}
    status = {"phase": "Running", "podIP": ip,
              "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    return membership.pod_view({"metadata": meta, "status": status})


def members(*names_: str) -> dict[str, membership.Member]:
    return {n: membership.Member(membership.MemberName(n), f"10.0.0.{i + 1}", 1.0) for i, n in enumerate(names_)}


def test_leaving_candidates_are_published_members_deleted_or_unready_that_still_have_an_ip():
    views = [view("serving"), view("deleted", deleting=True), view("unready", ready=False),
             view("no-ip", deleting=True, ip=None), view("never-published", deleting=True),
             view("other-app", deleting=True, app="web")]
    previous = ["serving", "deleted", "unready", "no-ip", "other-app"]
    assert list(membership.leaving(views, SELECTOR, previous)) == ["deleted", "unready"]
    assert list(membership.members(views, SELECTOR)) == ["serving"]


def test_moved_tenants_warm_from_the_leaver_first_with_a_surviving_old_home_as_fallback():
    now = members("a", "b", "d")
    leavers = {"c": membership.Member(membership.MemberName("c"), "10.0.0.7", 1.0)}
    moves = [
        TenantMove("t1", ("c", "b"), ("b", "d")),  # c leaves: b promoted to first, d gained
        TenantMove("t2", ("c", "e"), ("a", "d")),  # the leaver is the only old home left
        TenantMove("t3", ("a", "b"), ("a", "d")),  # not the leaver's: from a surviving home
    ]
    plan = warmup.plan(moves, now, 1 << 20, leavers)
    got = [(r.tenant, r.target, r.source, r.fallback) for r in plan.requests]
    assert got == [("t1", "b", "c", None), ("t1", "d", "c", "b"), ("t2", "a", "c", None),
                   ("t2", "d", "c", None), ("t3", "d", "a", None)]
    assert plan.cold_tenants == ()
    fallback = plan.requests[1].from_fallback()
    assert (fallback.target, fallback.source, fallback.key) == ("d", "b", plan.requests[1].key)
    # A leaver that did not answer "draining" is no source: as before, t2 starts cold.
    silent = warmup.plan(moves, now, 1 << 20)
    assert [(r.tenant, r.target, r.source) for r in silent.requests] == [("t1", "d", "b"), ("t3", "d", "a")]
    assert silent.cold_tenants == ("t2",)


@pytest.fixture
def spec() -> policy.KVCachePolicySpec:
    return policy.parse_policy(yaml.safe_load((EXAMPLES_DIR / "llama-70b-interactive.yaml").read_text())).spec


@pytest.mark.parametrize("grace, patched", [(5, True), (None, False), (120, False)])
def test_injection_raises_the_grace_period_to_cover_the_drain_and_never_lowers_it(spec, grace, patched):
    pod = {"metadata": {"name": "p", "labels": {"app": "llm"}},
           "spec": {"containers": [{"name": "engine", "image": "e"}],
                    **({"terminationGracePeriodSeconds": grace} if grace is not None else {})}}
    patch = injection.inject(pod, "chat", spec, injection.SidecarImage(image="kvtier:test"))
    needed = injection.sidecar_grace_s()
    assert needed > injection.SIDECAR_SHUTDOWN_HEADROOM_S
    effective = patch["spec"].get("terminationGracePeriodSeconds", grace if grace is not None else 30)
    assert ("terminationGracePeriodSeconds" in patch["spec"]) is patched
    assert effective >= needed and effective >= (grace or 0)
