"""The operator's token opens one sidecar: it mints (TokenRequest, short-lived) a token of
its ServiceAccount per sidecar, for that pod's own audience, and the webhook tells each
sidecar to accept only its own. A token one sidecar received, replayed at another, is
refused; so is a token for the sidecars' old shared audience."""
from __future__ import annotations

import pytest

from kvtier import control_api
from kvtier.sidecar_config import DEFAULT_CONTROL_AUDIENCE
from kvtier_operator import names
from kvtier_testenv.kubectl import Kubectl
from kvtier_testenv.ports import free_port
from operator_harness import OPERATOR_NAMESPACE, OPERATOR_SA, RunningOperator, operator_options, register_webhook, \
    wait_for
from sidecar_fleet import PodSidecar, serving_pod, tiny_policy
from test_operator_e2e import short_workdir, status_of

pytestmark = pytest.mark.k8s


def stats_status(sidecar: PodSidecar, token: str) -> int:
    return sidecar.control.get("/cache/stats", headers={"Authorization": f"Bearer {token}"}, timeout_s=10)[0]


@pytest.fixture
def minting_operator(namespace, operator_kubeconfig, control_plane, tmp_path, monkeypatch):
    admin = Kubectl(control_plane.kubeconfig)
    role = f"{namespace}-tokenreview"  # the serving pods' ServiceAccount may create TokenReviews
    admin.run("create", "clusterrole", role, "--verb=create", "--resource=tokenreviews.authentication.k8s.io")
    admin.run("create", "clusterrolebinding", role, f"--clusterrole={role}", f"--serviceaccount={namespace}:default")
    port = free_port()
    options = operator_options(tmp_path, port, sidecar_auth="tokenreview",
                               sidecar_token_service_account=f"{OPERATOR_NAMESPACE}/{OPERATOR_SA}",
                               sidecar_auth_users=f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_SA}")
    hook = register_webhook(admin, namespace, open(options.webhook_cert, "rb").read(), port)
    op = RunningOperator(namespace, operator_kubeconfig, options, monkeypatch).start()
    yield op
    op.stop()
    admin.delete("mutatingwebhookconfiguration", hook)
    admin.run("delete", "clusterrolebinding", role, check=False)
    admin.run("delete", "clusterrole", role, check=False)


def test_a_token_for_one_sidecar_is_refused_by_another(minting_operator, kubectl, control_plane, node_agent_factory):
    admin = Kubectl(control_plane.kubeconfig, namespace=OPERATOR_NAMESPACE)
    wait_for("kube-root-ca.crt", lambda: kubectl.run("get", "configmap", "kube-root-ca.crt", check=False).returncode == 0)
    agent = node_agent_factory(workdir=short_workdir(), service_account_tokens=True)
    kubectl.apply(tiny_policy("tiny", "llm"))
    wait_for("sidecar ConfigMap", lambda: kubectl.run(
        "get", "configmap", names.sidecar_config_map("tiny"), check=False).returncode == 0)
    sidecars = {}
    for i, pod in enumerate(("llm-0", "llm-1")):
        body = serving_pod(pod, "llm")
        body["spec"]["serviceAccountName"] = "default"
        kubectl.apply(body)
        try:
            agent.wait_ready(i + 1, selector="app=llm", timeout_s=60)
            sidecars[pod] = PodSidecar.of(agent, kubectl.namespace, pod)
        except (TimeoutError, KeyError) as exc:
            raise AssertionError(f"{exc}\nsidecar log:\n{agent.log(kubectl.namespace, pod)}") from None
        if pod == "llm-0":
            sidecars[pod].seed("tenant-a", 1)
    # The operator got through to both with tokens it minted (only authenticated stats tell it the tenant).
    wait_for("the operator's authenticated stats", lambda: status_of(kubectl, "tiny").get("knownTenants") == 1,
             timeout_s=60)

    def token(audience: str) -> str:
        return admin.run("create", "token", OPERATOR_SA, f"--audience={audience}").stdout.strip()

    for pod, sidecar in sidecars.items():
        other = next(p for p in sidecars if p != pod)
        own = token(control_api.pod_audience(kubectl.namespace, pod))
        assert stats_status(sidecar, own) == 200
        assert stats_status(sidecars[other], own) == 401  # replayed at another sidecar
    shared = token(DEFAULT_CONTROL_AUDIENCE)  # what a leaked projected token used to open: every sidecar
    assert {stats_status(s, shared) for s in sidecars.values()} == {401}
