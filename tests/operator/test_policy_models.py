"""The pydantic models behind the CRD: examples parse, invalid policies are rejected
with the same message the apiserver gives, defaults are the design's numbers."""
from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from kvtier import policy
from operator_cases import example_paths, invalid_cases

CEL_MESSAGES = {
    rule.message
    for cls in vars(policy).values()
    if isinstance(cls, type) and issubclass(cls, policy.CamelModel)
    for rule in cls.__dict__.get("CEL_RULES", ())
}


def test_there_are_examples_and_at_least_ten_invalid_cases():
    assert len(example_paths()) >= 3
    assert len(invalid_cases()) >= 10


@pytest.mark.parametrize("path", example_paths(), ids=lambda p: p.stem)
def test_every_example_parses(path):
    parsed = policy.parse_policy(yaml.safe_load(path.read_text()))
    assert parsed.kind == "KVCachePolicy"
    assert parsed.spec.rollout.steps[-1] == 100


@pytest.mark.parametrize("case", invalid_cases(), ids=lambda c: c.path.stem)
def test_every_invalid_policy_is_rejected_by_the_models(case):
    with pytest.raises(ValidationError) as err:
        policy.parse_policy(case.body)
    # Cross-field rules share their message with the CEL rule the apiserver runs.
    cel_message = next((m for m in CEL_MESSAGES if case.expect in m), None)
    if cel_message is not None:
        assert case.expect in str(err.value)


def test_minimal_policy_gets_the_design_defaults():
    spec = policy.parse_policy(yaml.safe_load((example_paths()[0].parent / "minimal.yaml").read_text())).spec
    assert spec.block_size == 16
    assert spec.traffic_class == "interactive"
    assert (spec.affinity.homes, spec.affinity.spill_occupancy, spec.affinity.balance_factor) == (3, 0.85, 1.25)
    assert (spec.admission.min_sightings, spec.admission.thrash_ratio) == (2, 0.9)
    assert spec.rollout.canary_pods == 1 and spec.rollout.steps == [10, 50, 100]
    assert spec.rollout.recovery.window_s == 1800 and spec.rollout.recovery.source == "sidecar"
    assert spec.tiers.nvme.mode == "off" and spec.tiers.peer.enabled
    assert spec.hardware.media.nvme_gbps == 7.0


def test_camel_case_on_the_wire_and_snake_case_in_python_round_trip():
    body = yaml.safe_load((example_paths()[0].parent / "batch-nvme.yaml").read_text())
    parsed = policy.parse_policy(body)
    wire = parsed.spec.k8s_json()
    assert wire["trafficClass"] == "batch" and wire["tiers"]["nvme"]["mode"] == "on"
    assert wire["rollout"]["recovery"]["prometheus"]["url"].startswith("http://")
    assert policy.KVCachePolicySpec.model_validate(wire) == parsed.spec


def test_label_selector_matches_like_kubernetes():
    sel = policy.LabelSelector.model_validate(
        {"matchLabels": {"app": "a"}, "matchExpressions": [
            {"key": "tier", "operator": "In", "values": ["gpu", "cpu"]},
            {"key": "kvtier.io/opt-out", "operator": "DoesNotExist"},
        ]}
    )
    assert sel.matches({"app": "a", "tier": "gpu"})
    assert not sel.matches({"app": "a", "tier": "tpu"})
    assert not sel.matches({"app": "a", "tier": "gpu", "kvtier.io/opt-out": "1"})
    assert not sel.matches({"app": "b", "tier": "gpu"})
    assert not sel.matches(None)


@pytest.mark.parametrize("text,seconds", [("30m", 1800), ("1h30m", 5400), ("45s", 45), ("2h", 7200)])
def test_durations_parse_to_seconds(text, seconds):
    assert policy.parse_duration_s(text) == seconds


@pytest.mark.parametrize("text", ["", "30", "m", "1d", "30 minutes"])
def test_bad_durations_are_refused_with_an_example(text):
    with pytest.raises(ValueError, match="like 30m"):
        policy.parse_duration_s(text)


@pytest.mark.parametrize("text,nbytes", [("1Gi", 2**30), ("500Gi", 500 * 2**30), ("64M", 64 * 10**6), ("1024", 1024)])
def test_quantities_parse_to_bytes(text, nbytes):
    assert policy.parse_quantity_bytes(text) == nbytes


def test_weights_version_must_be_an_exact_digest():
    good = "sha256:" + "ab" * 32
    assert policy.ModelSpec(id="m", weights_version=good, preset="llama-3-70b").weights_version == good
    with pytest.raises(ValidationError):
        policy.ModelSpec(id="m", weights_version="sha256:" + "AB" * 32, preset="llama-3-70b")
