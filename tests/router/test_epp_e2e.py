"""kvtier's real Endpoint Picker end to end (issue #23): the `kvtier-epp` binary
scripts/setup.sh builds (hack/epp.sh) serves an InferencePool on the session's real
kube-apiserver, and router/epp's extproc-gateway drives it over its real ext_proc gRPC
protocol, as a gateway would (kvtier_testenv.epp). One EPP for the module, reading the
affinity table from a file and from a real Redis that takes a password (given to the
EPP as a redisPasswordFile, as the chart mounts the Secret).

Four serving pods, mid-rollout: vllm-a and vllm-b serve weights v1, vllm-c and vllm-d
v2 (kvtier.io/weights-version). No vLLM behind them: a stub at each pod's address serves
vLLM's metrics with a KV occupancy the test sets (10% unless a test makes a home hot),
so a tenant lands on the first home of its order among the version screener's
candidates, and spills from a hot one. The tests run in file order: the last one takes
the table to Redis and kills Redis.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier import names
from kvtier_testenv import epp
from kvtier_testenv.controlplane import ControlPlane
from kvtier_testenv.k8s_fixtures import namespace_name
from kvtier_testenv.kubectl import Kubectl
from kvtier_testenv.polling import wait_for
from kvtier_testenv.ports import free_port
from kvtier_testenv.redis_fixtures import RedisServer

pytestmark = [pytest.mark.k8s, pytest.mark.redis]

POOL = "kvtier"
SELECTOR = {"app": "vllm"}
# name -> (IP, weights version)
PODS = {"vllm-a": ("127.0.0.11", "v1"), "vllm-b": ("127.0.0.12", "v1"),
        "vllm-c": ("127.0.0.13", "v2"), "vllm-d": ("127.0.0.14", "v2")}
V1 = {PODS["vllm-a"][0], PODS["vllm-b"][0]}
V2 = {PODS["vllm-c"][0], PODS["vllm-d"][0]}
REDIS_KEY = "kvt:affinity:serving:llama"
REDIS_PASSWORD = "s3cret-from-the-secret"
COOL, HOT = 0.1, 0.95  # KV occupancy: HOT is over spillOccupancy (0.85) and 1.25 x the mean


def table(epoch: int, acme_home: str) -> dict:
    """The operator's table: acme's first home `acme_home`; `rollout-new` first on a v2
    pod, `rollout-old` on a v1 one (their second homes across the versions)."""
    return {"epoch": epoch, "members": {p: 1 for p in PODS}, "homes": 2,
            "homeOverrides": {"acme": [acme_home, "vllm-d"], "default": ["vllm-c", "vllm-a"],
                              "rollout-new": ["vllm-d", "vllm-a"], "rollout-old": ["vllm-b", "vllm-c"]}}


def ip(endpoint: str) -> str:
    return endpoint.rsplit(":", 1)[0]


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    with RedisServer(password=REDIS_PASSWORD) as server:
        yield server


@pytest.fixture(scope="module")
def table_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("epp") / "table.json"
    path.write_text(json.dumps(table(1, "vllm-b")))
    return path


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, epp.EngineMetrics]]:
    """Each pod's /metrics on its IP and the pool's targetPort (one free port for all)."""
    port = free_port()
    stubs = {}
    try:
        for name, (pod_ip, _version) in PODS.items():
            stubs[name] = epp.EngineMetrics(pod_ip, port, kv_usage=COOL)
        yield stubs
    finally:
        for stub in stubs.values():
            stub.stop()


@pytest.fixture(scope="module")
def picker(control_plane: ControlPlane, redis: RedisServer, table_file: Path, engines: dict[str, epp.EngineMetrics],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[epp.Picker]:
    bins = epp.find()  # fails loudly (EppBinariesMissing: run scripts/setup.sh)
    work = tmp_path_factory.mktemp("epp-run")
    admin = Kubectl(control_plane.kubeconfig)
    namespace = namespace_name("epp-e2e")
    admin.run("create", "namespace", namespace)
    kubectl = admin.in_namespace(namespace)
    crds: list[str] = []
    try:
        crds = epp.install_pool_crds(admin)
        port = engines["vllm-a"].server.server_address[1]
        epp.apply_pool(kubectl, POOL, SELECTOR, target_port=port)
        for name, (pod_ip, version) in PODS.items():
            epp.serving_pod(kubectl, name, pod_ip, {**SELECTOR, names.WEIGHTS_VERSION_LABEL: version},
                            target_port=port)
        password_file = work / "redis-password"
        password_file.write_text(REDIS_PASSWORD + "\n")
        config = work / "epp.yaml"
        config.write_text(epp.picker_config(
            table_file, checkInterval="200ms", redisUrl=f"redis://{redis.host}:{redis.port}/0",
            redisKey=REDIS_KEY, redisPasswordFile=str(password_file), redisInterval="200ms"))
        with epp.Picker(bins, control_plane.kubeconfig, namespace, POOL, config, work / "epp.log",
                        target_port=port) as p:
            try:
                # up, and all four pods known (each is some tenant's first home)
                for tenant, pod in (("acme", "vllm-b"), ("rollout-new", "vllm-d"), ("default", "vllm-c")):
                    p.wait_lands(f"the EPP to route {tenant} to {pod}", PODS[pod][0], f"x-tenant-id={tenant}",
                                 timeout_s=epp.START_TIMEOUT_S)
                yield p
            except BaseException:
                print(f"kvtier-epp's log ({work / 'epp.log'}):\n{p.log_tail()}\nlast gateway error: {p.last_error}")
                raise
    finally:
        admin.delete("namespace", namespace, wait=False)
        epp.remove_crds(admin, crds)  # leave the shared API server as it was


def routed(picker: epp.Picker, *headers: str | bytes) -> dict:
    """One request that must be routed: an endpoint, no immediate (error) response."""
    r = picker.ask(*headers)
    assert r is not None, f"the exchange failed: {picker.last_error}"
    assert not r.get("immediateStatus"), f"the EPP answered {r['immediateStatus']}: {r.get('immediateBody')}"
    assert r.get("endpoint"), r
    return r


def test_a_tenant_lands_on_its_home_and_its_body_carries_its_cache_salt(picker: epp.Picker):
    for _ in range(10):
        r = routed(picker, "x-tenant-id=acme")
        assert r["endpoint"] == picker.endpoint(PODS["vllm-b"][0])
        assert r["body"]["cache_salt"] == "acme"
        assert r["body"]["messages"] == [{"role": "user", "content": "hi"}]


def test_the_peer_pull_hint_reaches_kv_transfer_params(picker: epp.Picker):
    r = routed(picker, "x-tenant-id=acme", "x-kv-cache-source-host-port=10.0.0.7:8100")
    assert r["body"]["kv_transfer_params"] == {"kvtier": {"sourcePeer": "10.0.0.7:8100"}}
    assert r["body"]["cache_salt"] == "acme"
    # a malformed hint is no hint
    r = routed(picker, "x-tenant-id=acme", "x-kv-cache-source-host-port=not-a-peer")
    assert "kv_transfer_params" not in r["body"]


@pytest.mark.parametrize("headers", [(), ("x-tenant-id=",), ("x-tenant-id=   ",), (b"x-tenant-id=\xff\xfe",)],
                         ids=["missing", "empty", "blank", "not-utf8"])
def test_a_bad_or_missing_tenant_routes_as_the_default_tenant(picker: epp.Picker, headers):
    r = routed(picker, *headers)
    assert r["endpoint"] == picker.endpoint(PODS["vllm-c"][0])  # the default tenant's home
    assert "cache_salt" not in r["body"]  # the connector keys it as the default tenant


def test_mid_rollout_a_tenant_stays_on_its_first_homes_version(picker: epp.Picker,
                                                               engines: dict[str, epp.EngineMetrics]):
    for tenant, want in (("rollout-new", V2), ("rollout-old", V1)):
        landed = {ip(routed(picker, f"x-tenant-id={tenant}")["endpoint"]) for _ in range(10)}
        assert landed <= want, f"{tenant} landed on {landed}, its version's pods are {want}"
    # tenants without an override: each on its own first home's version, every time
    for i in range(8):
        tenant = f"tenant-{i}"
        landed = {ip(routed(picker, f"x-tenant-id={tenant}")["endpoint"]) for _ in range(3)}
        assert landed <= V1 or landed <= V2, f"{tenant} crossed versions: {landed}"
    # A hot first home spills within its version, past the second home of the other one:
    # rollout-new's homes are vllm-d (v2), vllm-a (v1); rollout-old's vllm-b (v1), vllm-c (v2).
    try:
        for tenant, hot, spill in (("rollout-new", "vllm-d", "vllm-c"), ("rollout-old", "vllm-b", "vllm-a")):
            engines[hot].kv_usage = HOT
            picker.wait_lands(f"{tenant} to spill from its hot first home {hot} to {spill}, of its version",
                              PODS[spill][0], f"x-tenant-id={tenant}", timeout_s=15)
            for _ in range(10):
                assert routed(picker, f"x-tenant-id={tenant}")["endpoint"] == picker.endpoint(PODS[spill][0])
    finally:
        for stub in engines.values():
            stub.kv_usage = COOL
    for tenant, home in (("rollout-new", "vllm-d"), ("rollout-old", "vllm-b"), ("acme", "vllm-b")):
        picker.wait_lands(f"{tenant} back on its cooled first home {home}", PODS[home][0], f"x-tenant-id={tenant}",
                          timeout_s=15)


def test_the_epp_follows_the_table_file_to_a_new_epoch(picker: epp.Picker, table_file: Path):
    table_file.write_text(json.dumps(table(2, "vllm-a")))
    picker.wait_lands("acme to follow the table's epoch 2 to vllm-a", PODS["vllm-a"][0], "x-tenant-id=acme",
                      timeout_s=15)
    # a torn write changes nothing: routing goes on from the last good table
    table_file.write_text('{"epoch": 3, "members"')
    for _ in range(5):
        assert routed(picker, "x-tenant-id=acme")["endpoint"] == picker.endpoint(PODS["vllm-a"][0])


def test_the_redis_table_wins_and_routing_survives_redis_death(picker: epp.Picker, redis: RedisServer):
    payload = {"table": table(10, "vllm-c"), "addresses": {}}
    reply = redis.command("SET", REDIS_KEY, json.dumps(json.dumps(payload)))
    assert reply.startswith(b"+OK"), reply
    picker.wait_lands("acme to follow Redis's epoch 10 (read with the password file) to vllm-c",
                      PODS["vllm-c"][0], "x-tenant-id=acme", timeout_s=15)
    redis.kill()
    assert not redis.ping()
    # the pollers keep failing (every 200 ms); routing goes on from Redis's last table
    wait_for("the EPP's poller to find Redis gone", lambda: "connection refused" in picker.log_tail(200),
             timeout_s=10)
    for _ in range(10):
        r = routed(picker, "x-tenant-id=acme")
        assert r["endpoint"] == picker.endpoint(PODS["vllm-c"][0])
        assert r["body"]["cache_salt"] == "acme"
