"""A policy the sidecar config cannot hold is refused at `kubectl apply` with the size
of one KV block; and one already stored (before the CRD knew the rule) never costs its
pods their admission: they are admitted without the sidecar, annotated with what to
fix, and the policy's status and Events count them, while the operator logs the
problem once instead of a traceback per pass."""
from __future__ import annotations

import copy
import json

import pytest

from kvtier import policy
from kvtier_operator import names
from kvtier_testenv.kubectl import Kubectl
from operator_cases import CRDS_DIR
from operator_harness import events, wait_for
from sidecar_fleet import serving_pod


pytestmark = pytest.mark.k8s

BLOCK_RULE_MARK = "cannot hold one KV block"


def llama_70b_in_one_mebibyte(name: str, app: str) -> dict:
    """Preset llama-3-70b (320 KiB of KV per token: a 5 MiB block) in a 1 MiB DRAM tier."""
    return {"apiVersion": "kvtier.io/v1alpha1", "kind": "KVCachePolicy", "metadata": {"name": name},
            "spec": {"selector": {"matchLabels": {"app": app}},
                     "model": {"id": "llama-3-70b-instruct", "weightsVersion": "sha256:" + "2" * 64,
                               "preset": "llama-3-70b"},
                     "hardware": {"gpuPreset": "h100"}, "tiers": {"dram": {"capacity": "1Mi"}}}}


def test_a_dram_tier_under_one_block_is_refused_by_the_apiserver_and_the_models_alike(kvcp_crd, kubectl):
    body = llama_70b_in_one_mebibyte("too-small", "llm")
    with pytest.raises(ValueError) as err:
        policy.parse_policy(body)
    assert policy.DRAM_BLOCK_MESSAGE in str(err.value)
    assert "here one block is 5242880 bytes and tiers.dram.capacity 1Mi is 1048576" in str(err.value)
    refused = kubectl.run("apply", "--server-side", "-f", "-", input=json.dumps(body), check=False)
    assert refused.returncode != 0 and policy.DRAM_BLOCK_MESSAGE in refused.stderr, refused.stderr
    # One block exactly fits; a smaller block size fits the same tier.
    body["spec"]["tiers"]["dram"]["capacity"] = "5Mi"
    kubectl.run("apply", "--server-side", "--dry-run=server", "-f", "-", input=json.dumps(body))
    body["spec"].update(blockSize=3, tiers={"dram": {"capacity": "1Mi"}})
    kubectl.run("apply", "--server-side", "--dry-run=server", "-f", "-", input=json.dumps(body))
    policy.parse_policy(body)


def _crd_without_the_block_rule() -> dict:
    """The installed CRD as an older release shipped it: without the one-block rule."""
    import yaml

    crd = yaml.safe_load((CRDS_DIR / "kvtier.io_kvcachepolicies.yaml").read_text())
    relaxed = copy.deepcopy(crd)
    spec = relaxed["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["x-kubernetes-validations"] = [r for r in spec["x-kubernetes-validations"]
                                        if BLOCK_RULE_MARK not in r["message"]]
    assert len(spec["x-kubernetes-validations"]) < len(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
                                                       ["properties"]["spec"]["x-kubernetes-validations"])
    return relaxed


def _store_past_the_rule(admin: Kubectl, kubectl: Kubectl, body: dict) -> None:
    """Store `body` as a cluster upgraded from an older CRD would hold it."""
    admin.apply(_crd_without_the_block_rule())
    try:
        wait_for("the relaxed CRD serving", lambda: kubectl.run(
            "apply", "--server-side", "-f", "-", input=json.dumps(body), check=False).returncode == 0)
    finally:
        admin.run("apply", "-f", str(CRDS_DIR))
    wait_for("the CRD's rule back", lambda: BLOCK_RULE_MARK in kubectl.run(
        "apply", "--server-side", "--dry-run=server", "-f", "-",
        input=json.dumps({**body, "metadata": {"name": "probe-rule"}}), check=False).stderr)


def _condition(kubectl: Kubectl, name: str, type_: str) -> dict | None:
    status = kubectl.get_json("kvcp", name).get("status") or {}
    return next((c for c in status.get("conditions", []) if c["type"] == type_), None)


def test_pods_of_a_stored_broken_policy_are_admitted_without_the_sidecar_and_counted(
        operator, kubectl, control_plane, kvcp_crd, caplog):
    admin = Kubectl(control_plane.kubeconfig)
    _store_past_the_rule(admin, kubectl, llama_70b_in_one_mebibyte("broken", "big"))
    wait_for("the policy's spec reported invalid", lambda: (c := _condition(kubectl, "broken", "Degraded"))
             and c["status"] == "True" and c["reason"] == "SpecInvalid" and BLOCK_RULE_MARK in c["message"])

    for pod in ("big-0", "big-1"):
        kubectl.apply(serving_pod(pod, "big"))  # admitted: a refusal would raise here
        stored = kubectl.get_json("pod", pod)
        assert [c["name"] for c in stored["spec"]["containers"]] == ["engine"]
        note = stored["metadata"]["annotations"][names.INJECTION_SKIPPED_ANNOTATION]
        assert note.startswith("broken: ") and BLOCK_RULE_MARK in note
        assert names.INJECTED_ANNOTATION not in stored["metadata"]["annotations"]

    injected = wait_for("the pods counted in status", lambda: (c := _condition(kubectl, "broken", "SidecarsInjected"))
                        and "big-1" in c["message"] and c)
    assert injected["status"] == "False" and injected["reason"] == "PolicyNotCarriedOut"
    assert BLOCK_RULE_MARK in injected["message"] and "fix the policy" in injected["message"]
    status = kubectl.get_json("kvcp", "broken")["status"]
    assert status["uninjectedPods"] == 2 and status["uninjectedPodNames"] == ["big-0", "big-1"]
    assert wait_for("a Warning Event", lambda: events(kubectl, "broken", "PolicyNotCarriedOut"))

    # Fixed at last (a tier that holds the block): the next pod gets its sidecar.
    fixed = llama_70b_in_one_mebibyte("broken", "big")
    fixed["spec"]["tiers"]["dram"]["capacity"] = "64Mi"
    kubectl.run("apply", "--server-side", "-f", "-", input=json.dumps(fixed))
    wait_for("the config rendered", lambda: (c := _condition(kubectl, "broken", "SidecarConfigRendered"))
             and c["status"] == "True")
    kubectl.apply(serving_pod("big-2", "big"))
    assert kubectl.get_json("pod", "big-2")["metadata"]["annotations"][names.INJECTED_ANNOTATION] == "broken"

    operator.stop()
    # The operator runs in this process: its log records are the test's to read.
    ours = [r for r in caplog.records if r.name.startswith("kvtier")]
    assert not [r.getMessage() for r in ours if r.exc_info], "a traceback was logged"
    assert len([r for r in ours if "cannot be carried out" in r.getMessage()]) == 1
