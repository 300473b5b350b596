"""`spec.redis.secretRef` end to end against a password-protected redis-server: the
operator reads the one Secret the chart lets it read (Role by resourceName) to publish
and, on deletion, withdraw the affinity table; the injected sidecar gets the URL from
the same Secret and joins the global index."""
from __future__ import annotations

import base64
import json
import os
import subprocess

import pytest
import redis as redis_sync
import yaml

from kvtier_operator import names
from kvtier_testenv import binaries
from kvtier_testenv.kubectl import Kubectl
from kvtier_testenv.redis_fixtures import RedisServer
from operator_harness import OPERATOR_NAMESPACE, wait_for
from sidecar_fleet import serving_pod, tiny_policy
from test_operator_e2e import short_workdir

CHART = os.path.join(os.path.dirname(__file__), "..", "..", "charts", "kvtier")
SECRET = "redis-auth"

pytestmark = pytest.mark.k8s


def chart_secret_rbac(namespace: str) -> list[dict]:
    """The Role and RoleBinding the chart renders for redisSecrets=[namespace/SECRET]."""
    values = json.dumps({"redisSecrets": [{"namespace": namespace, "name": SECRET}]})
    out = subprocess.run([str(binaries.find().helm), "template", "kvtier", CHART, "--namespace", OPERATOR_NAMESPACE,
                          "--values", "/dev/stdin"], input=values, capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d and d["kind"] in ("Role", "RoleBinding")]


@pytest.fixture
def password_redis():
    password = base64.b16encode(os.urandom(12)).decode().lower()
    server = RedisServer(password=password).start()
    yield server, server.url
    server.stop()


def test_secret_ref_publishes_to_a_password_redis_and_sidecars_join_it(
        operator, kubectl, control_plane, password_redis, node_agent_factory):
    server, url = password_redis
    anonymous = redis_sync.Redis(host=server.host, port=server.port)
    with pytest.raises(redis_sync.AuthenticationError):
        anonymous.get("x")  # the server really wants the password
    client = redis_sync.Redis.from_url(url)
    admin = Kubectl(control_plane.kubeconfig)
    for obj in chart_secret_rbac(kubectl.namespace):
        admin.run("apply", "-f", "-", input=json.dumps(obj))
    kubectl.run("create", "secret", "generic", SECRET, f"--from-literal=url={url}")
    key = names.REDIS_AFFINITY_KEY.format(namespace=kubectl.namespace, name="tiny")

    kubectl.apply(tiny_policy("tiny", "llm", redis={"secretRef": {"name": SECRET, "key": "url"}}))
    wait_for("the affinity table in the password-protected Redis", lambda: client.get(key), timeout_s=60)

    agent = node_agent_factory(workdir=short_workdir())
    kubectl.apply(serving_pod("llm-0", "llm"))
    agent.wait_ready(1, selector="app=llm", timeout_s=60)
    env = agent.process(kubectl.namespace, "llm-0").env
    assert env["KVTIER_REDIS_URL"] == url  # from the Secret, never written into the ConfigMap
    config_map = kubectl.get_json("configmap", names.sidecar_config_map("tiny"))
    assert url not in json.dumps(config_map)
    wait_for("the sidecar in the index's members", lambda: client.zcard("kvt:members") == 1, timeout_s=60)
    wait_for("the epoch naming llm-0", lambda: "llm-0" in (client.get(key) or b"").decode(), timeout_s=60)

    kubectl.delete("kvcp", "tiny")
    wait_for("the table withdrawn from Redis", lambda: client.get(key) is None, timeout_s=60)
