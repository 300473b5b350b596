"""A KVCachePolicy that serves from the NVMe tier makes the webhook mount a hostPath
volume into its serving pods, which PodSecurity's baseline and restricted levels refuse.
The chart's ValidatingAdmissionPolicy makes the real API server refuse such a policy at
`kubectl apply` in a namespace enforcing either level, with a message naming the field
and the fix; the same policy is accepted where the namespace enforces privileged (or
nothing), and a policy with NVMe off is accepted under restricted."""
from __future__ import annotations

import copy
import json
import uuid
from pathlib import Path

import pytest
import yaml

from helm_chart import CHART, render
from kvtier_testenv import polling
from kvtier_testenv.kubectl import Kubectl

pytestmark = pytest.mark.k8s

ROOT = Path(__file__).resolve().parents[2]
ENFORCE = "pod-security.kubernetes.io/enforce"


def nvme_policy(namespace: str, mode: str) -> dict:
    body = yaml.safe_load((ROOT / "examples" / "minimal.yaml").read_text())
    body["metadata"].update(name=f"nvme-{mode}", namespace=namespace)
    body["spec"]["tiers"] = {"nvme": {"mode": mode}}
    body["spec"]["trafficClass"] = "batch"  # serving from NVMe ("on") is for batch traffic only
    return body


def dry_run(kubectl: Kubectl, body: dict):
    return kubectl.run("apply", "--dry-run=server", "-f", "-", input=json.dumps(body), check=False)


def test_the_chart_renders_the_policy_only_where_the_api_serves_it():
    assert ("ValidatingAdmissionPolicy", "kvtier-nvme-pod-security") not in render()
    api = ["--api-versions", "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy"]
    objects = render(extra=api)
    binding = objects[("ValidatingAdmissionPolicyBinding", "kvtier-nvme-pod-security")]
    assert binding["spec"] == {"policyName": "kvtier-nvme-pod-security", "validationActions": ["Deny"]}


def test_a_policy_asking_for_nvme_is_refused_where_pod_security_forbids_hostpath(helm, control_plane):
    admin = Kubectl(control_plane.kubeconfig)
    release = f"kvt-{uuid.uuid4().hex[:6]}"
    # No pod of any namespace is sent to this release's webhook (nothing serves it).
    helm.install(release, CHART, values={"webhook": {"namespaceSelector": {"matchLabels": {"kvtier.io/none": "x"}}}})
    levels = {"restricted": None, "baseline": None, "privileged": None, "unlabelled": None}
    try:
        for level in levels:
            ns = f"nvme-{level[:5]}-{uuid.uuid4().hex[:6]}"
            admin.run("create", "namespace", ns)
            if level != "unlabelled":
                admin.run("label", "namespace", ns, f"{ENFORCE}={level}")
            levels[level] = ns
        # The binding takes effect asynchronously: probe until the restricted case is refused.
        refused = polling.wait_for("the admission policy in force", lambda: (
            "mounts the node NVMe path" in (r := dry_run(admin, nvme_policy(levels["restricted"], "on"))).stderr
            and r), 60, 0.5)
        for level in ("restricted", "baseline"):
            for mode in ("on", "shadow"):
                r = dry_run(admin, nvme_policy(levels[level], mode))
                assert r.returncode != 0, f"{mode} NVMe admitted under {level}"
                assert f"spec.tiers.nvme.mode: {mode} mounts the node NVMe path" in r.stderr, r.stderr
                assert f"{ENFORCE}: {level}" in r.stderr and "set spec.tiers.nvme.mode: off" in r.stderr, r.stderr
        assert "Forbidden" in refused.stderr or "forbidden" in refused.stderr, refused.stderr
        for level in ("privileged", "unlabelled"):
            r = dry_run(admin, nvme_policy(levels[level], "on"))
            assert r.returncode == 0, f"NVMe refused under {level}: {r.stderr}"
        off = copy.deepcopy(nvme_policy(levels["restricted"], "off"))
        r = dry_run(admin, off)
        assert r.returncode == 0, r.stderr
    finally:
        helm.run("uninstall", release, "--wait")
        for ns in levels.values():
            if ns:
                admin.delete("namespace", ns, wait=False)
