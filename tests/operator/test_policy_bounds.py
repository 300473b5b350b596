"""Everything the CRD accepts, the operator can carry out: shared prefixes are bounded
so the rendered sidecar config fits its ConfigMap with margin (and client-side
`kubectl apply` still fits its annotation), a ConfigMap the API refuses is a Degraded
condition with the reason, and generated policies — valid and invalid — are either
rejected by the apiserver with a message or reconciled without an operator exception."""
from __future__ import annotations

import json
import re
import uuid

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvtier import policy
from kvtier_operator import names, sidecar_render
from kvtier_testenv.kubectl import Kubectl
from operator_harness import events, wait_for
from sidecar_fleet import tiny_policy

# A ConfigMap's data may hold 1 MiB; the stated margin is 4x at the CRD's bound.
CONFIGMAP_LIMIT_BYTES = 1 << 20
MAX_TOKEN_ID = 4294967295


def at_the_bound(name: str) -> dict:
    """Shared prefixes holding exactly the allowed total, every id at its widest."""
    per = policy._MAX_PREFIX_TOKENS
    n = policy.MAX_SHARED_PREFIX_TOKENS_TOTAL // per
    prefixes = [{"name": f"p{i}", "tokenIds": [MAX_TOKEN_ID] * per} for i in range(n)]
    return tiny_policy(name, "bounded", sharedPrefixes=prefixes)


def test_widest_policy_the_crd_accepts_renders_a_quarter_of_a_configmap():
    spec = policy.parse_policy(at_the_bound("widest")).spec
    size = len(sidecar_render.render(spec).text.encode())
    assert size <= sidecar_render.MAX_CONFIG_BYTES <= CONFIGMAP_LIMIT_BYTES // 2
    assert size <= CONFIGMAP_LIMIT_BYTES // 4


def test_render_over_budget_raises_with_the_size_and_the_fix():
    body = at_the_bound("over")
    spec = policy.KVCachePolicySpec.model_construct(**policy.parse_policy(body).spec.__dict__)
    prefix = policy.SharedPrefix(name="p", token_ids=[MAX_TOKEN_ID] * policy._MAX_PREFIX_TOKENS)
    spec.shared_prefixes = [prefix] * 8  # past the CRD bound: only model_construct gets here
    with pytest.raises(sidecar_render.ConfigTooLarge, match="65536 token ids.*shorten sharedPrefixes"):
        sidecar_render.render(spec)


def test_policy_at_the_bound_applies_client_side_and_is_reconciled(operator, kubectl):
    kubectl.apply(at_the_bound("widest"))  # client-side: the last-applied annotation still fits
    status = wait_for("config rendered", lambda: _condition(kubectl, "widest", "SidecarConfigRendered"))
    assert status["status"] == "True"
    assert _condition(kubectl, "widest", "Degraded")["status"] == "False"
    cm = kubectl.get_json("configmap", names.sidecar_config_map("widest"))
    assert len(cm["data"][names.CONFIG_KEY].encode()) <= CONFIGMAP_LIMIT_BYTES // 4


def test_one_token_past_the_total_is_rejected_with_the_bound_in_the_message(kvcp_crd, kubectl):
    body = at_the_bound("past")
    body["spec"]["sharedPrefixes"].append({"name": "one-more", "tokenIds": [1]})
    result = kubectl.run("apply", "--server-side", "-f", "-", input=yaml.safe_dump(body), check=False)
    assert result.returncode != 0
    assert "sharedPrefixes: at most 16384 token ids in all" in result.stderr


def test_configmap_the_api_refuses_is_a_degraded_condition_with_the_reason_and_an_event(
        operator, kubectl, control_plane, namespace):
    admin = Kubectl(control_plane.kubeconfig)
    vap = f"deny-sidecar-config-{namespace}"
    admin.apply({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": vap},
        "spec": {"failurePolicy": "Fail",
                 "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                                                         "operations": ["CREATE", "UPDATE"], "resources": ["configmaps"]}]},
                 "validations": [{"expression": f"!has(object.metadata.labels) || object.metadata.labels[?'{names.COMPONENT_LABEL}'].orValue('') != 'sidecar-config'",
                                  "message": "sidecar configs are not allowed in this namespace"}]}})
    admin.apply({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": vap},
        "spec": {"policyName": vap, "validationActions": ["Deny"],
                 "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}}}})
    try:
        # The binding takes effect asynchronously: probe until a labelled ConfigMap is refused.
        probe = {"apiVersion": "v1", "kind": "ConfigMap",
                 "metadata": {"name": "probe", "labels": {names.COMPONENT_LABEL: "sidecar-config"}}}
        # Server-side dry run: admission runs, nothing is stored (so a probe admitted
        # before the binding took effect cannot make a later one fail as AlreadyExists).
        wait_for("admission policy active", lambda: "denied request" in kubectl.run(
            "create", "--dry-run=server", "-f", "-", input=json.dumps(probe), check=False).stderr)
        kubectl.apply(tiny_policy("refused", "r"))
        degraded = wait_for("Degraded", lambda: (c := _condition(kubectl, "refused", "Degraded")) and c["status"] == "True" and c)
        assert degraded["reason"] == "SidecarConfigRejected"
        assert "sidecar configs are not allowed" in degraded["message"]
        assert _condition(kubectl, "refused", "SidecarConfigRendered")["status"] == "False"
        assert wait_for("event", lambda: events(kubectl, "refused", "SidecarConfigRejected"))
    finally:
        admin.delete("validatingadmissionpolicybinding", vap)
        admin.delete("validatingadmissionpolicy", vap)
    output = operator.stop()
    assert "Traceback" not in output


def _condition(kubectl: Kubectl, name: str, type_: str) -> dict | None:
    status = kubectl.get_json("kvcp", name).get("status") or {}
    return next((c for c in status.get("conditions", []) if c["type"] == type_), None)


# --- generated policies -------------------------------------------------------------------

_token_ids = st.lists(st.integers(-1, MAX_TOKEN_ID + 1), min_size=0, max_size=40)
_prefix = st.builds(lambda n, ids, big: {"name": n, "tokenIds": ids * big},
                    st.sampled_from(["a", "b", "c", "sys", "BAD_NAME", ""]), _token_ids,
                    st.sampled_from([1, 1, 1, 300, 500]))
_mutations = st.fixed_dictionaries({}, optional={
    "sharedPrefixes": st.lists(_prefix, max_size=70),
    "blockSize": st.one_of(st.integers(-2, 1100), st.just("16"), st.booleans()),
    "trafficClass": st.sampled_from(["interactive", "batch", "realtime"]),
    "tiers": st.fixed_dictionaries({}, optional={
        "dram": st.fixed_dictionaries({"capacity": st.sampled_from(["1Gi", "16Mi", "0", "lots", "1.5Ti"])}),
        "nvme": st.fixed_dictionaries({"mode": st.sampled_from(["off", "shadow", "on", "maybe"])}),
    }),
    "rollout": st.fixed_dictionaries({}, optional={
        "steps": st.lists(st.integers(-5, 120), max_size=12),
        "canaryPods": st.integers(-1, 5),
    }),
    "redis": st.sampled_from([{"url": "redis://127.0.0.1:1/0"}, {"secretRef": {"name": "r"}},
                              {"url": "redis://x", "secretRef": {"name": "r"}}, {}, {"url": "http://x"}]),
    "affinity": st.fixed_dictionaries({"spillOccupancy": st.floats(-0.5, 1.5, allow_nan=False)}),
    "unknownField": st.just(1),
})


def _model_accepts(body: dict) -> bool:
    try:
        policy.parse_policy(body)
        return True
    except (ValidationError, ValueError):
        return False


_outcomes: list[str] = []


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(mutation=_mutations)
def _check_generated(kubectl: Kubectl, mutation: dict) -> None:
    name = f"gen-{uuid.uuid4().hex[:8]}"
    body = tiny_policy(name, "gen", **mutation)
    result = kubectl.run("apply", "--server-side", "-f", "-", input=json.dumps(body), check=False)
    if result.returncode != 0:
        # A refusal names the field to fix (schema errors and CEL rules both say where).
        assert re.search(r"spec[\w.\[\]]*: \S", result.stderr), result.stderr
        _outcomes.append("rejected")
        return
    stored = kubectl.get_json("kvcp", name)
    assert _model_accepts(stored), mutation  # what the apiserver stores, the operator can read
    generation = stored["metadata"]["generation"]
    status = wait_for(f"{name} reconciled", lambda: (s := kubectl.get_json("kvcp", name).get("status") or {})
                      .get("observedGeneration") == generation and s)
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds["SidecarConfigRendered"]["status"] == "True" or conds["Degraded"]["status"] == "True"
    kubectl.delete("kvcp", name, wait=True)
    _outcomes.append("reconciled")


def test_generated_policies_are_rejected_with_a_message_or_reconciled_without_an_operator_exception(operator, kubectl):
    _outcomes.clear()
    _check_generated(kubectl)
    assert {"rejected", "reconciled"} <= set(_outcomes), _outcomes  # the strategy reaches both sides
    output = operator.stop()
    assert "Traceback" not in output and "Handler 'spec_changed' failed" not in output
