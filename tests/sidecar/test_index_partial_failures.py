"""Redis failures are per operation, against real redis-servers: out of memory under
`noeviction` and a READONLY replica refuse writes while lookups keep answering; a
killed primary refuses both. Writes queue and resume; each state is in stats and
/metrics."""
import asyncio
import time

import pytest
import redis as redis_sync
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MovedError, OutOfMemoryError, ReadOnlyError, ResponseError, TryAgainError

from kvtier_sidecar.client import EngineHit, SidecarClient
from kvtier_sidecar.global_index import GlobalIndex
from kvtier_sidecar.redis_health import Breaker, Health, classify, opens_both
from kvtier_testenv.redis_fixtures import RedisServer

from .test_sidecar_process import poll, prompt, seed_cache

TAG = "ab" * 16


def hashes(n: int, salt: str = "") -> list[str]:
    return [f"{salt}{i:030x}"[-32:] for i in range(n)]


def health_series(metrics: str, operation: str, state: str) -> float:
    """The value of kvtier_index_health{operation, state} in a /metrics page."""
    for line in metrics.splitlines():
        if line.startswith("kvtier_index_health{") and f'operation="{operation}"' in line and f'state="{state}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no kvtier_index_health series for {operation}/{state}")


async def until(fn, timeout_s: float = 15.0, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while not (value := await fn()):
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        await asyncio.sleep(every_s)
    return value


@pytest.mark.parametrize("exc, health", [
    (OutOfMemoryError("OOM command not allowed"), Health.OOM),
    (ReadOnlyError("READONLY You can't write against a read only replica."), Health.READONLY),
    (ResponseError("Command # 1 (HSET) of pipeline caused error: OOM command not allowed"), Health.ERROR),
    (ResponseError("OOM command not allowed"), Health.OOM),
    (MovedError("3999 127.0.0.1:6381"), Health.MOVED),
    (TryAgainError("TRYAGAIN"), Health.MOVED),
    (RedisConnectionError("refused"), Health.UNREACHABLE),
    (asyncio.TimeoutError(), Health.UNREACHABLE),
])
def test_classify_names_each_redis_failure(exc, health):
    assert classify(exc) is health
    assert opens_both(health) == (health is Health.UNREACHABLE)


def test_breaker_backs_off_exponentially_and_closes_on_success():
    b = Breaker()
    assert b.allows(0.0)
    assert b.failed(Health.OOM, 10.0) == 0.25 and not b.allows(10.2) and b.allows(10.25)
    assert b.failed(Health.OOM, 11.0) == 0.5 and b.state is Health.OOM
    for _ in range(10):
        b.failed(Health.OOM, 12.0)
    assert b.backoff_s == 5.0
    b.succeeded()
    assert (b.state, b.backoff_s, b.allows(0.0)) == (Health.OK, 0.25, True)


def test_out_of_memory_refuses_writes_while_lookups_keep_answering_then_writes_resume(redis_server_fn):
    async def go():
        holder = GlobalIndex(redis_server_fn.url, "10.0.0.1:1", timeout_s=0.5)
        me = GlobalIndex(redis_server_fn.url, "10.0.0.9:1", timeout_s=0.5)
        holder.register(TAG, hashes(8))
        assert await holder.flush()
        await holder.heartbeat()
        admin = redis_sync.Redis.from_url(redis_server_fn.url)
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)  # every write is now over the limit
        holder.register(TAG, hashes(4, salt="f"))
        assert await holder.flush() is False and holder.pending == 4
        assert holder.health() == {"reads": "ok", "writes": "oom"}
        assert holder.stats["register_errors_oom"] == 1
        # Lookups, from a host that never wrote and from the one whose writes fail, still answer.
        answer = await me.longest_prefix(TAG, hashes(8))
        assert answer.matched_blocks == 8 and answer.hosts == ["10.0.0.1:1"]
        assert (await holder.longest_prefix(TAG, hashes(8))) is None  # itself is never an answer
        assert holder.available and not holder.writable
        # The heartbeat's write is refused; its member read still refreshes.
        holder.writes.down_until = 0.0
        await holder.heartbeat()
        assert holder.stats["heartbeat_errors_oom"] == 1 and holder.stats["members_errors"] == 0
        assert "10.0.0.1:1" in holder._members
        admin.config_set("maxmemory", 0)
        await until(holder.flush)
        assert holder.pending == 0 and holder.health() == {"reads": "ok", "writes": "ok"}
        assert (await me.longest_prefix(TAG, hashes(4, salt="f"))).matched_blocks == 4
        await holder.close(); await me.close()
    asyncio.run(go())


def test_readonly_replica_serves_lookups_and_queues_writes_until_promoted():
    with RedisServer() as primary, RedisServer() as replica:
        writer = GlobalIndex(primary.url, "10.0.0.1:1", timeout_s=0.5)
        demoted = GlobalIndex(replica.url, "10.0.0.2:1", timeout_s=0.5)

        async def go():
            writer.register(TAG, hashes(6))
            assert await writer.flush()
            admin = redis_sync.Redis.from_url(replica.url)
            admin.replicaof(primary.host, primary.port)
            deadline = time.monotonic() + 30
            while admin.info("replication").get("master_link_status") != "up":
                assert time.monotonic() < deadline, "replica did not sync"
                await asyncio.sleep(0.1)
            # Reads on the replica: the primary's entries are there.
            answer = await until(lambda: demoted.longest_prefix(TAG, hashes(6)))
            assert answer.matched_blocks == 6 and answer.hosts == ["10.0.0.1:1"]
            demoted.register(TAG, hashes(3, salt="e"))
            assert await demoted.flush() is False and demoted.pending == 3
            assert demoted.health() == {"reads": "ok", "writes": "readonly"}
            assert demoted.stats["register_errors_readonly"] == 1
            assert (await demoted.longest_prefix(TAG, hashes(6))).matched_blocks == 6  # still reads
            admin.replicaof("NO", "ONE")  # promoted (a failover made it the primary)
            await until(demoted.flush)
            assert demoted.pending == 0 and demoted.health()["writes"] == "ok"
            assert admin.hexists(demoted.block_key(TAG, hashes(3, salt="e")[0]), "10.0.0.2:1")
            await writer.close(); await demoted.close()
        asyncio.run(go())


def test_killed_primary_refuses_reads_and_writes_fast_then_both_resume(redis_server_fn):
    async def go():
        idx = GlobalIndex(redis_server_fn.url, "10.0.0.1:1", timeout_s=0.3)
        me = GlobalIndex(redis_server_fn.url, "10.0.0.9:1", timeout_s=0.3)
        redis_server_fn.kill()
        assert await me.longest_prefix(TAG, hashes(3)) is None
        assert me.health() == {"reads": "unreachable", "writes": "unreachable"}
        t0 = time.perf_counter()
        assert await me.longest_prefix(TAG, hashes(3)) is None  # breaker open: no round trip
        open_s = time.perf_counter() - t0
        idx.register(TAG, hashes(3))
        assert await idx.flush() is False and idx.health()["writes"] == "unreachable"
        assert idx.health()["reads"] == "unreachable"  # a dead server opens both
        assert open_s < me.timeout_s  # answered without waiting for a Redis timeout
        redis_server_fn.start()
        await until(idx.flush)
        answer = await until(lambda: me.longest_prefix(TAG, hashes(3)))
        assert answer.matched_blocks == 3
        assert idx.health() == {"reads": "unreachable", "writes": "ok"}  # idx has not read since
        assert me.health()["reads"] == "ok"
        await idx.close(); await me.close()
    asyncio.run(go())


def test_sidecar_under_redis_oom_keeps_peer_hits_and_shows_the_write_state_in_stats_and_metrics(
        spawn, oracle, redis_server_fn, secret_file):
    url = redis_server_fn.url
    a = spawn("a", "127.0.0.2", url, secret_file)
    b = spawn("b", "127.0.0.3", url, secret_file)
    ca, cb = SidecarClient(a.socket), SidecarClient(b.socket)
    before = prompt(200, seed=1)
    seed_cache(ca, oracle, "t", before)
    poll(lambda: a.stats()["index"]["counters"].get("registered_blocks", 0) >= 12)
    admin = redis_sync.Redis.from_url(url)
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)
    seed_cache(ca, oracle, "t", prompt(200, seed=2))
    # Whichever write meets the OOM first pauses writes: the new blocks' registration or
    # the heartbeat (every 2 s); either way the blocks wait in the queue.
    index = poll(lambda: (i := a.stats()["index"])["writes"] == "oom" and i["pending_blocks"] > 0 and i)
    oom = index["counters"].get("register_errors_oom", 0) + index["counters"].get("heartbeat_errors_oom", 0)
    assert index["reads"] == "ok" and oom >= 1, index
    metrics = a.get("/metrics")[1].decode()
    assert health_series(metrics, "writes", "oom") == 1.0 and health_series(metrics, "writes", "ok") == 0.0
    assert health_series(metrics, "reads", "ok") == 1.0
    # B's lookup of what A registered before the OOM is still a peer hit.
    hit = cb.lookup(oracle.root("t"), before)
    assert isinstance(hit, EngineHit) and hit.tier == "peer" and hit.matched_tokens == 192
    cb.release(hit)
    assert a.get("/readyz")[0] == 200
    admin.config_set("maxmemory", 0)
    index = poll(lambda: (i := a.stats()["index"])["writes"] == "ok" and i["pending_blocks"] == 0 and i, timeout_s=20)
    assert health_series(a.get("/metrics")[1].decode(), "writes", "ok") == 1.0
