"""The Redis global index against a real redis-server."""
import asyncio
import time

import redis as redis_sync

from kvtier_sidecar.global_index import GlobalIndex

TAG = "ab" * 16


def hashes(n: int, salt: str = "") -> list[str]:
    return [f"{salt}{i:030x}"[-32:] for i in range(n)]


def run(coro):
    return asyncio.run(coro)


def test_longest_prefix_held_by_one_host_wins_in_one_round_trip(redis_url):
    async def go():
        a = GlobalIndex(redis_url, "10.0.0.1:1")
        b = GlobalIndex(redis_url, "10.0.0.2:1")
        me = GlobalIndex(redis_url, "10.0.0.9:1")
        hs = hashes(125)  # a 2,000-token prompt
        a.register(TAG, hs[:40])
        b.register(TAG, hs[:90])
        assert await a.flush() and await b.flush()
        r = redis_sync.Redis.from_url(redis_url)
        before = int(r.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))
        answer = await me.longest_prefix(TAG, hs)
        after = int(r.info("commandstats")["cmdstat_evalsha"]["calls"])
        assert answer.matched_blocks == 90 and answer.hosts == ["10.0.0.2:1"]
        assert after - before == 1
        # The asking host never finds itself.
        b_answer = await b.longest_prefix(TAG, hs)
        assert b_answer.matched_blocks == 40 and b_answer.hosts == ["10.0.0.1:1"]
        for i in (a, b, me):
            await i.close()
    run(go())


def test_divergent_chain_stops_the_match(redis_url):
    async def go():
        a = GlobalIndex(redis_url, "h1:1")
        a.register(TAG, hashes(10))
        await a.flush()
        other = hashes(3) + hashes(7, salt="f")
        me = GlobalIndex(redis_url, "me:1")
        answer = await me.longest_prefix(TAG, other)
        assert answer.matched_blocks == 3
        assert await me.longest_prefix("cd" * 16, hashes(10)) is None  # another key root
        await a.close(); await me.close()
    run(go())


def test_expired_host_entries_are_ignored_even_when_the_key_lives(redis_url):
    async def go():
        old = GlobalIndex(redis_url, "old:1", ttl_s=1)
        fresh = GlobalIndex(redis_url, "fresh:1", ttl_s=600)
        old.register(TAG, hashes(8))
        fresh.register(TAG, hashes(4))
        await old.flush(); await fresh.flush()
        me = GlobalIndex(redis_url, "me:1")
        assert (await me.longest_prefix(TAG, hashes(8))).matched_blocks == 8
        deadline = time.time() + 5
        while time.time() < deadline:
            answer = await me.longest_prefix(TAG, hashes(8))
            if answer.hosts == ["fresh:1"]:
                break
            await asyncio.sleep(0.2)
        assert answer.matched_blocks == 4 and answer.hosts == ["fresh:1"]
        for i in (old, fresh, me):
            await i.close()
    run(go())


def test_redis_down_is_a_fast_miss_and_writes_resume_when_it_returns(redis_server_fn):
    async def go():
        idx = GlobalIndex(redis_server_fn.url, "h:1", timeout_s=0.2)
        # A socket timeout many times the request deadline: waiting for it would show.
        me = GlobalIndex(redis_server_fn.url, "me:1", timeout_s=0.2, socket_timeout_s=5.0)
        redis_server_fn.kill()
        t0 = time.perf_counter()
        assert await me.longest_prefix(TAG, hashes(5)) is None
        # Cut by the request path's deadline, not the Redis client's socket timeout.
        assert time.perf_counter() - t0 < me.socket_timeout_s
        assert await me.longest_prefix(TAG, hashes(5)) is None  # breaker open: Redis not asked
        assert me.stats["lookup_errors"] == 1
        idx.register(TAG, hashes(5))
        assert await idx.flush() is False and idx.pending == 5
        redis_server_fn.start()
        deadline = time.monotonic() + 10
        while not await idx.flush():
            assert time.monotonic() < deadline, "index writes did not resume"
            await asyncio.sleep(0.1)
        assert idx.pending == 0
        while (answer := await me.longest_prefix(TAG, hashes(5))) is None:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        assert answer.matched_blocks == 5
        await idx.close(); await me.close()
    run(go())


def test_deregister_withdraws_entries_and_membership(redis_url):
    async def go():
        a = GlobalIndex(redis_url, "a:1")
        a.register(TAG, hashes(6))
        await a.flush()
        await a.heartbeat()
        r = redis_sync.Redis.from_url(redis_url)
        assert r.zscore(a.members_key, "a:1") is not None
        await a.deregister()
        assert r.zscore(a.members_key, "a:1") is None
        me = GlobalIndex(redis_url, "me:1")
        assert await me.longest_prefix(TAG, hashes(6)) is None
        await a.close(); await me.close()
    run(go())


def test_a_redis_that_lost_its_data_gets_this_hosts_entries_again_at_the_next_heartbeat(redis_url):
    async def go():
        a = GlobalIndex(redis_url, "h1:1")
        me = GlobalIndex(redis_url, "me:1")
        hs = hashes(12)
        await a.heartbeat()
        a.register(TAG, hs)
        assert await a.flush()
        assert (await me.longest_prefix(TAG, hs)).matched_blocks == 12
        redis_sync.Redis.from_url(redis_url).flushall()  # a restart without persistence
        assert await me.longest_prefix(TAG, hs) is None
        await a.heartbeat()
        answer = await me.longest_prefix(TAG, hs)
        assert answer.matched_blocks == 12 and answer.hosts == ["h1:1"]
        assert a.stats["republished_blocks"] == 12
        # A heartbeat that finds its own entry writes nothing again.
        await a.heartbeat()
        assert a.stats["republished_blocks"] == 12
        await a.close(); await me.close()
    run(go())
