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


async def publish_redis(url: str, namespace: str, policy_name: str, table: AffinityTable,
                        members: Mapping[str, Member]) -> bool:
    """SET the table and PUBLISH its epoch. False (logged) if Redis is unreachable."""
    import redis.asyncio as aioredis

    key = names.REDIS_AFFINITY_KEY.format(namespace=namespace, name=policy_name)
    payload = json.dumps(_redis_payload(table, members))
    client = aioredis.from_url(url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)
    try:
        async with client.pipeline(transaction=True) as pipe:
            pipe.set(key, payload)
            pipe.publish(names.REDIS_AFFINITY_CHANNEL, json.dumps({"key": key, "epoch": table.epoch}))
            await pipe.execute()
        return True
    except Exception as exc:  # any Redis fault: the ConfigMap is still the record
        log.warning("could not publish affinity epoch %s to Redis: %s", table.epoch, exc)
        return False
    finally:
        await client.aclose()


async def ensure_redis(url: str, namespace: str, policy_name: str, table: AffinityTable,
                       members: Mapping[str, Member]) -> bool:
    """Publish unless Redis already holds exactly this table and these addresses (one
    GET when it does). False (logged) if Redis is unreachable."""
    import redis.asyncio as aioredis

    key = names.REDIS_AFFINITY_KEY.format(namespace=namespace, name=policy_name)
    client = aioredis.from_url(url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)
    try:
        current = await client.get(key)
    except Exception as exc:  # any Redis fault: retried on the next pass
        log.info("could not read the Redis affinity key: %s", exc)
        return False
    finally:
        await client.aclose()
    try:
        if current is not None and _redis_payload(table, members) == json.loads(current):
            return True
    except ValueError:
        pass  # unreadable: overwrite it

    return await publish_redis(url, namespace, policy_name, table, members)


def _redis_payload(table: AffinityTable, members: Mapping[str, Member]) -> dict[str, Any]:
    return {"table": json.loads(table.to_json()), "addresses": addresses(members)}


async def delete_redis(url: str, namespace: str, policy_name: str) -> None:
    import redis.asyncio as aioredis

    client = aioredis.from_url(url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)
    try:
        await client.delete(names.REDIS_AFFINITY_KEY.format(namespace=namespace, name=policy_name))
    except Exception as exc:
        log.warning("could not delete the Redis affinity key: %s", exc)
    finally:
        await client.aclose()
