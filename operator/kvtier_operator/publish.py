"""Where routers read the affinity table: a ConfigMap (the record) and, when the
policy names a Redis, a key plus a pub/sub notice (a hint: routers fall back to the
ConfigMap). The body builders are pure; `publish_redis` is the only I/O here."""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from kvtier.affinity import AffinityTable

from kvtier_operator import names
from kvtier_operator.membership import Member

log = logging.getLogger("kvtier.operator.publish")

REDIS_TIMEOUT_S = 2.0


def addresses(members: Mapping[str, Member]) -> dict[str, dict[str, str]]:
    """Member name -> where to reach it (routers need the IP; sidecars the peer port)."""
    return {n: {"ip": m.ip, "http": m.http_url(), "peer": m.peer_address()} for n, m in sorted(members.items())}


def affinity_config_map(
    policy_name: str, namespace: str, table: AffinityTable, members: Mapping[str, Member]
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": names.affinity_config_map(policy_name),
            "namespace": namespace,
            "labels": {names.POLICY_LABEL: policy_name, names.COMPONENT_LABEL: "affinity"},
            "annotations": {f"{names.PREFIX}/epoch": str(table.epoch)},
        },
        "data": {
            names.AFFINITY_KEY: table.to_json(),
            names.ADDRESSES_KEY: json.dumps(addresses(members), sort_keys=True),
        },
    }


def read_table(config_map: Mapping[str, Any] | None) -> AffinityTable | None:
    """The published table, or None if there is none (or it is unreadable: a fresh epoch
    sequence is better than a crash loop)."""
    if not config_map:
        return None
    text = (config_map.get("data") or {}).get(names.AFFINITY_KEY)
    if not text:
        return None
    try:
        return AffinityTable.from_json(text)
    except ValueError as exc:
        log.warning("published affinity table unreadable, starting over: %s", exc)
        return None


def _redis_client(url: str, cluster: bool):
    import redis.asyncio as aioredis

    timeouts = {"socket_timeout": REDIS_TIMEOUT_S, "socket_connect_timeout": REDIS_TIMEOUT_S}
    if cluster:
        return aioredis.RedisCluster.from_url(url, **timeouts)
    return aioredis.from_url(url, **timeouts)


async def publish_redis(url: str, namespace: str, policy_name: str, table: AffinityTable,
                        members: Mapping[str, Member], cluster: bool = False) -> bool:
    """SET the table, then PUBLISH its epoch (in that order, so a subscriber that reads
    on the message sees the new table). False (logged) if Redis is unreachable."""
    key = names.REDIS_AFFINITY_KEY.format(namespace=namespace, name=policy_name)
    payload = json.dumps(_redis_payload(table, members))
    try:
        client = _redis_client(url, cluster)
    except Exception as exc:  # a cluster client contacts a node on construction
        log.warning("could not publish affinity epoch %s to Redis: %s", table.epoch, exc)
        return False
    try:
        await client.set(key, payload)
        await client.publish(names.REDIS_AFFINITY_CHANNEL, json.dumps({"key": key, "epoch": table.epoch}))
        return True
    except Exception as exc:  # any Redis fault: the ConfigMap is still the record
        log.warning("could not publish affinity epoch %s to Redis: %s", table.epoch, exc)
        return False
    finally:
        await client.aclose()


async def ensure_redis(url: str, namespace: str, policy_name: str, table: AffinityTable,
                       members: Mapping[str, Member], cluster: bool = False) -> bool:
    """Publish unless Redis already holds exactly this table and these addresses (one
    GET when it does). False (logged) if Redis is unreachable."""
    key = names.REDIS_AFFINITY_KEY.format(namespace=namespace, name=policy_name)
    try:
        client = _redis_client(url, cluster)
        try:
            current = await client.get(key)
        finally:
            await client.aclose()
    except Exception as exc:  # any Redis fault: retried on the next pass
        log.info("could not read the Redis affinity key: %s", exc)
        return False
    try:
        if current is not None and _redis_payload(table, members) == json.loads(current):
            return True
    except ValueError:
        pass  # unreadable: overwrite it

    return await publish_redis(url, namespace, policy_name, table, members, cluster)


def _redis_payload(table: AffinityTable, members: Mapping[str, Member]) -> dict[str, Any]:
    return {"table": json.loads(table.to_json()), "addresses": addresses(members)}


async def delete_redis(url: str, namespace: str, policy_name: str, cluster: bool = False) -> None:
    try:
        client = _redis_client(url, cluster)
    except Exception as exc:
        log.warning("could not delete the Redis affinity key: %s", exc)
        return
    try:
        await client.delete(names.REDIS_AFFINITY_KEY.format(namespace=namespace, name=policy_name))
    except Exception as exc:
        log.warning("could not delete the Redis affinity key: %s", exc)
    finally:
        await client.aclose()
