"""The control API against the real kube-apiserver's TokenReview: only the operator's
audience-bound ServiceAccount token opens the mutating endpoints and per-tenant stats;
401 without a valid token, 403 for another identity, and nothing changes."""
from __future__ import annotations

import json

import pytest

from kvtier_sidecar.client import EngineHit, Miss, SidecarClient
from kvtier_testenv.kubectl import Kubectl

from .test_sidecar_process import poll, prompt, seed_cache

pytestmark = pytest.mark.k8s

AUDIENCE = "kvtier-sidecar"


def call(sc, method: str, path: str, token: str | None = None, body: dict | None = None) -> tuple[int, dict | str]:
    status, raw = sc.control.request(method, path, body,
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {token}"} if token else {})},
                                     timeout_s=10)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


@pytest.fixture()
def identities(control_plane, namespace, tmp_path):
    """ServiceAccounts in a fresh namespace: the operator, an intruder, and the serving
    pods' own (allowed to create TokenReviews, nothing else); tokens minted by TokenRequest."""
    admin = Kubectl(control_plane.kubeconfig, namespace=namespace)
    for sa in ("kvtier-operator", "intruder", "serving"):
        admin.run("create", "serviceaccount", sa)
    role = f"{namespace}-tokenreview"
    admin.run("create", "clusterrole", role, "--verb=create", "--resource=tokenreviews.authentication.k8s.io")
    admin.run("create", "clusterrolebinding", role, f"--clusterrole={role}", f"--serviceaccount={namespace}:serving")

    def token(sa: str, audience: str | None = AUDIENCE) -> str:
        return admin.run("create", "token", sa, *([f"--audience={audience}"] if audience else [])).stdout.strip()

    serving = tmp_path / "serving-token"
    serving.write_text(token("serving", None))
    yield {"operator": token("kvtier-operator"), "intruder": token("intruder"),
           "operator_for_the_api_server": token("kvtier-operator", None),
           "serving_token_file": str(serving), "operator_user": f"system:serviceaccount:{namespace}:kvtier-operator",
           "intruder_user": f"system:serviceaccount:{namespace}:intruder"}
    admin.run("delete", "clusterrolebinding", role, check=False)
    admin.run("delete", "clusterrole", role, check=False)


def test_only_the_operators_token_opens_the_control_api_and_refusals_change_nothing(
        spawn, oracle, control_plane, identities):
    sc = spawn(control_auth={"mode": "tokenreview", "api_server": control_plane.url,
                             "ca_file": str(control_plane.ca_cert), "token_file": identities["serving_token_file"],
                             "allowed_users": [identities["operator_user"]]})
    engine = SidecarClient(sc.socket)
    root, tokens = oracle.root("t"), prompt(64, seed=11)
    seed_cache(engine, oracle, "t", tokens)
    assert isinstance(hit := engine.lookup(root, tokens), EngineHit)
    engine.release(hit)
    invalidate = {"model_version": root.weights_version}

    # Unauthenticated, forged, or minted for another audience: 401; another identity: 403.
    for token, expected in ((None, 401), ("not-a-token", 401), (identities["operator_for_the_api_server"], 401),
                            (identities["intruder"], 403)):
        assert call(sc, "POST", "/cache/invalidate", token, invalidate)[0] == expected, token
        assert call(sc, "POST", "/cache/drain/done", token, {})[0] == expected
        assert call(sc, "POST", "/cache/warm", token, {"tenant": "t", "from_peer": "127.0.0.9:1", "max_bytes": 1})[0] == expected
        assert call(sc, "GET", "/cache/stats?tenant=t", token)[0] == expected
        assert call(sc, "GET", "/cache/jobs", token)[0] == expected
        assert call(sc, "GET", "/cache/hot?tenant=t&max_tokens=64", token)[0] == expected
    status, body = call(sc, "POST", "/cache/invalidate", None, invalidate)
    assert "bearer token" in body["error"]
    assert "may not use" in call(sc, "POST", "/cache/invalidate", identities["intruder"], invalidate)[1]["error"]
    # Nothing changed: no job ran, the blocks still serve.
    operator = identities["operator"]
    assert call(sc, "GET", "/cache/jobs", operator) == (200, {})
    assert isinstance(hit := engine.lookup(root, tokens), EngineHit)
    engine.release(hit)

    # Probes and metrics stay open.
    for path in ("/healthz", "/readyz", "/metrics"):
        assert call(sc, "GET", path)[0] == 200, path

    # The operator's token works, and its answer is cached (no review per call).
    status, stats = call(sc, "GET", "/cache/stats", operator)
    assert status == 200
    reviews = stats["sidecar"]["token_reviews"]
    for _ in range(5):
        assert call(sc, "GET", "/cache/stats?tenant=t", operator)[0] == 200
    assert call(sc, "GET", "/cache/stats", operator)[1]["sidecar"]["token_reviews"] == reviews
    status, hot = call(sc, "GET", "/cache/hot?tenant=t&max_tokens=64", operator)  # t's own prefix, for the operator
    assert status == 200 and [p["token_ids"] for p in hot["prefixes"]] == [tokens[:64].tolist()]
    assert call(sc, "POST", "/cache/invalidate", operator, invalidate)[0] == 202
    poll(lambda: isinstance(engine.lookup(root, tokens), Miss))


def test_no_api_server_to_ask_fails_closed_with_503(spawn, tmp_path):
    sc = spawn(control_auth={"mode": "tokenreview", "api_server": "https://127.0.0.1:1",
                             "token_file": str(tmp_path / "missing-token"), "allowed_users": ["someone"]})
    assert call(sc, "POST", "/cache/invalidate", "some-token", {"model_version": "v"})[0] == 503
    assert call(sc, "GET", "/healthz")[0] == 200


def test_protected_metrics_admit_the_metrics_users_who_get_nothing_else(spawn, control_plane, identities):
    scraper = identities["intruder_user"]  # stands for Prometheus's ServiceAccount here
    sc = spawn(control_auth={"mode": "tokenreview", "api_server": control_plane.url, "protect_metrics": True,
                             "ca_file": str(control_plane.ca_cert), "token_file": identities["serving_token_file"],
                             "allowed_users": [identities["operator_user"]], "metrics_users": [scraper]})
    assert call(sc, "GET", "/metrics")[0] == 401
    assert call(sc, "GET", "/metrics", identities["operator"])[0] == 200
    assert call(sc, "GET", "/metrics", identities["intruder"])[0] == 200
    assert call(sc, "GET", "/cache/stats", identities["intruder"])[0] == 403  # metrics only
    assert call(sc, "GET", "/healthz")[0] == 200
