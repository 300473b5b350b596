"""Overlapping selectors: the ownership rule (injected-by for life, then the oldest policy,
then the name) and the SelectorConflict condition both policies report."""
from __future__ import annotations

from kvtier import policy
from kvtier_operator.conflicts import PodLabels, PolicyRef, observation, overlaps, owner


def sel(**labels) -> policy.LabelSelector:
    return policy.LabelSelector(match_labels=labels)


OLD = PolicyRef("zeta", "2026-01-01T00:00:00Z", sel(app="llm"))
NEW = PolicyRef("alpha", "2026-03-01T00:00:00Z", sel(app="llm"))
TWIN = PolicyRef("beta", "2026-01-01T00:00:00Z", sel(app="llm"))


def test_oldest_selecting_policy_owns_an_uninjected_pod_whatever_the_names():
    assert owner({"app": "llm"}, None, [NEW, OLD]) == "zeta"
    assert owner({"app": "web"}, None, [NEW, OLD]) is None
    assert owner({"app": "llm"}, None, [OLD, TWIN]) == "beta"  # same age: the name decides


def test_injected_by_annotation_keeps_a_pod_with_the_policy_that_injected_it():
    assert owner({"app": "llm"}, "alpha", [NEW, OLD]) == "alpha"
    # Its sidecar runs that policy's config: gone or no longer selecting it, the pod is
    # nobody's until it is recreated, never adopted by another selecting policy.
    assert owner({"app": "llm"}, "gone", [NEW, OLD]) is None
    narrowed = PolicyRef("alpha", NEW.created, sel(app="llm", tier="gpu"))
    assert owner({"app": "llm"}, "alpha", [narrowed, OLD]) is None


def test_overlap_is_reported_by_both_policies_with_the_shared_pods_and_their_owner():
    pods = [PodLabels("llm-0", {"app": "llm"}, "zeta"), PodLabels("llm-1", {"app": "llm"}, None),
            PodLabels("web-0", {"app": "web"}, None)]
    for this in (OLD, NEW):
        found = overlaps(this, pods, [OLD, NEW])
        other = "alpha" if this is OLD else "zeta"
        assert found == {other: {"llm-0": "zeta", "llm-1": "zeta"}}
        obs = observation(this, found)
        assert (obs.type, obs.status, obs.reason) == ("SelectorConflict", "True", "OverlappingSelectors")
        assert f"policy {other} also selects llm-0 (owned by zeta), llm-1 (owned by zeta)" in obs.message
    assert observation(OLD, overlaps(OLD, pods, [OLD])).status == "False"


def test_condition_names_at_most_a_few_pods_and_counts_the_rest():
    pods = [PodLabels(f"llm-{i}", {"app": "llm"}, None) for i in range(12)]
    message = observation(OLD, overlaps(OLD, pods, [OLD, NEW])).message
    assert "and 7 more" in message and "llm-9" not in message  # names sort as text
