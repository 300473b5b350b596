"""The operator's identity end to end: the webhook tells injected sidecars whom to
accept, the sidecars check the operator's audience-bound token with TokenReview using
their pod's own ServiceAccount, and the operator's stats calls get through while an
anonymous caller gets 401. All of it over TLS: the operator issued the policy's
certificate from its CA into the Secret the webhook mounts, the control port refuses
plain HTTP, and a client expecting another policy's name gets no connection."""
from __future__ import annotations

import base64
from http.client import HTTPException
import json
import ssl

import pytest

from kvtier import control_tls
from kvtier_operator import control_ca, names
from kvtier_testenv.control_client import ControlEndpoint
from kvtier_testenv.kubectl import Kubectl
from kvtier_testenv.ports import free_port
from operator_harness import OPERATOR_NAMESPACE, OPERATOR_SA, RunningOperator, operator_options, register_webhook, \
    wait_for
from sidecar_fleet import PodSidecar, serving_pod, tiny_policy
from test_operator_e2e import short_workdir, status_of

pytestmark = pytest.mark.k8s

AUDIENCE = "kvtier-sidecar"


def http(sidecar: PodSidecar, method: str, path: str, token: str | None = None) -> int:
    return sidecar.control.request(method, path, body={} if method == "POST" else None,
                                   headers={"Authorization": f"Bearer {token}"} if token else {}, timeout_s=10)[0]


@pytest.fixture
def authed_operator(namespace, operator_kubeconfig, control_plane, tmp_path, monkeypatch):
    admin = Kubectl(control_plane.kubeconfig)
    token = admin.run("-n", OPERATOR_NAMESPACE, "create", "token", OPERATOR_SA, f"--audience={AUDIENCE}").stdout.strip()
    token_file = tmp_path / "sidecar-token"
    token_file.write_text(token)
    # The serving pods' ServiceAccount may create TokenReviews, and nothing else.
    role = f"{namespace}-tokenreview"
    admin.run("create", "clusterrole", role, "--verb=create", "--resource=tokenreviews.authentication.k8s.io")
    admin.run("create", "clusterrolebinding", role, f"--clusterrole={role}", f"--serviceaccount={namespace}:default")
    port = free_port()
    options = operator_options(tmp_path, port, sidecar_auth="tokenreview", sidecar_token_file=str(token_file),
                               sidecar_auth_users=f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_SA}")
    hook = register_webhook(admin, namespace, open(options.webhook_cert, "rb").read(), port)
    op = RunningOperator(namespace, operator_kubeconfig, options, monkeypatch).start()
    yield op, token
    op.stop()
    admin.delete("mutatingwebhookconfiguration", hook)
    admin.run("delete", "clusterrolebinding", role, check=False)
    admin.run("delete", "clusterrole", role, check=False)


def test_injected_sidecars_accept_only_the_operators_token(authed_operator, kubectl, node_agent_factory):
    _, operator_token = authed_operator
    # The token volume carries the cluster CA from the namespace's kube-root-ca.crt, which
    # the controller-manager publishes shortly after the namespace exists.
    wait_for("kube-root-ca.crt", lambda: kubectl.run("get", "configmap", "kube-root-ca.crt", check=False).returncode == 0)
    agent = node_agent_factory(workdir=short_workdir(), service_account_tokens=True)
    kubectl.apply(tiny_policy("tiny", "llm"))
    # The operator is up (and its webhook with it) once it rendered the policy's config.
    wait_for("sidecar ConfigMap", lambda: kubectl.run(
        "get", "configmap", names.sidecar_config_map("tiny"), check=False).returncode == 0)
    first = serving_pod("llm-0", "llm")
    first["spec"]["serviceAccountName"] = "default"
    kubectl.apply(first)
    try:
        agent.wait_ready(1, selector="app=llm", timeout_s=60)
        sidecar = PodSidecar.of(agent, kubectl.namespace, "llm-0")
    except (TimeoutError, KeyError) as exc:
        raise AssertionError(f"{exc}\nsidecar log:\n{agent.log(kubectl.namespace, 'llm-0')}") from None
    sidecar.seed("tenant-a", 1)
    # The policy's certificate, from the operator's CA, for the policy's name.
    secret = kubectl.get_json("secret", names.control_tls_secret("tiny"))
    assert secret["type"] == "kubernetes.io/tls"
    assert base64.b64decode(secret["data"]["ca.crt"]) == sidecar.control.ca_pem
    assert sidecar.control.server_name == control_tls.server_name(kubectl.namespace, "tiny")
    record = control_ca.Issued.from_record(
        kubectl.get_json("kvcp", "tiny")["metadata"]["annotations"][names.CONTROL_CERT_ANNOTATION])
    assert record is not None and record.names[0] == sidecar.control.server_name
    # HTTPS only: plain HTTP gets no HTTP answer; another policy's name does not verify.
    with pytest.raises((OSError, HTTPException)):
        ControlEndpoint(sidecar.ip, 8081).get("/healthz")
    with pytest.raises(ssl.SSLCertVerificationError):
        ControlEndpoint(sidecar.ip, 8081, control_tls.server_name(kubectl.namespace, "other"),
                        sidecar.control.ca_pem).get("/healthz")
    # Nobody but the operator may read tenants or change the cache.
    assert http(sidecar, "GET", "/cache/stats") == 401
    assert http(sidecar, "POST", "/cache/invalidate") == 401
    assert http(sidecar, "GET", "/healthz") == 200
    # A second pod joining makes the operator read every member's stats: with its token
    # it learns the tenant seeded above (only an authenticated stats call tells it).
    second = serving_pod("llm-1", "llm")
    second["spec"]["serviceAccountName"] = "default"
    kubectl.apply(second)
    agent.wait_ready(2, selector="app=llm", timeout_s=60)
    wait_for("the operator's authenticated stats", lambda: status_of(kubectl, "tiny").get("knownTenants") == 1,
             timeout_s=60)
    status, body = sidecar.control.get("/cache/stats", headers={"Authorization": f"Bearer {operator_token}"})
    assert status == 200 and json.loads(body)["sidecar"]["token_reviews"] >= 1
