"""The affinity table in Redis: a single server and a real Redis Cluster."""
from __future__ import annotations

import asyncio
import json

import pytest
import redis

from kvtier import policy
from kvtier.affinity import AffinityTable
from kvtier.routing import pick
from kvtier_operator import membership, names, publish, sidecar_render

MEMBERS = {n: membership.Member(membership.MemberName(n), f"10.0.0.{i + 1}", 1.0)
           for i, n in enumerate(["llm-0", "llm-1", "llm-2"])}
TABLE = AffinityTable(epoch=3, members={m: 1.0 for m in MEMBERS})
KEY = names.REDIS_AFFINITY_KEY.format(namespace="ns", name="p")


def _read(client) -> dict:
    return json.loads(client.get(KEY))


@pytest.mark.parametrize("mode", ["server", "cluster"])
def test_published_table_reads_back_and_routes_like_the_original(mode, request):
    if mode == "server":
        url, cluster = request.getfixturevalue("redis_url"), False
        reader = redis.Redis.from_url(url)
    else:
        nodes = request.getfixturevalue("redis_cluster")
        url, cluster = nodes.url, True
        reader = redis.RedisCluster.from_url(url)
    assert asyncio.run(publish.publish_redis(url, "ns", "p", TABLE, MEMBERS, cluster))
    got = _read(reader)
    table = AffinityTable.model_validate(got["table"])
    assert table.epoch == 3 and got["addresses"] == publish.addresses(MEMBERS)
    for tenant in (f"tenant-{i}" for i in range(50)):
        assert pick(tenant, table, {}) == pick(tenant, TABLE, {})
    # Level-based: the same table is not rewritten; a changed one is.
    assert asyncio.run(publish.ensure_redis(url, "ns", "p", TABLE, MEMBERS, cluster))
    newer = AffinityTable(epoch=4, members={m: 1.0 for m in list(MEMBERS)[:2]})
    assert asyncio.run(publish.ensure_redis(url, "ns", "p", newer, MEMBERS, cluster))
    assert _read(reader)["table"]["epoch"] == 4
    asyncio.run(publish.delete_redis(url, "ns", "p", cluster))
    assert reader.get(KEY) is None


def test_unreachable_redis_is_reported_not_raised():
    url = "redis://127.0.0.1:1"
    assert asyncio.run(publish.publish_redis(url, "ns", "p", TABLE, MEMBERS)) is False
    assert asyncio.run(publish.publish_redis(url, "ns", "p", TABLE, MEMBERS, cluster=True)) is False
    assert asyncio.run(publish.ensure_redis(url, "ns", "p", TABLE, MEMBERS, cluster=True)) is False


def test_a_cluster_policy_renders_a_cluster_sidecar_config():
    body = {"selector": {"matchLabels": {"app": "llm"}},
            "model": {"id": "m", "weightsVersion": "sha256:" + "a" * 64, "preset": "llama-3-8b"},
            "hardware": {"gpuPreset": "h100"},
            "redis": {"url": "redis://redis-0.redis:6379", "cluster": True}}
    spec = policy.KVCachePolicySpec.model_validate(body)
    config = sidecar_render.sidecar_config(spec)
    assert config.redis_cluster is True and config.redis_url == "redis://redis-0.redis:6379"
    body["redis"].pop("cluster")
    assert sidecar_render.sidecar_config(policy.KVCachePolicySpec.model_validate(body)).redis_cluster is False
