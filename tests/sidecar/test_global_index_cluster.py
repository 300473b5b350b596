"""The global index on a REAL Redis Cluster (three redis-server primaries joined with
`redis-cli --cluster create`): hash-tagged keys put one key root's blocks on one shard,
so the one-call Lua query works there; roots spread over shards; a SIGKILLed shard is
a miss, never an exception; two sidecar processes find each other through it."""
import asyncio
import hashlib
import time

import redis as redis_sync

from kvtier.keys import block_hashes
from kvtier_sidecar.client import SidecarClient
from kvtier_sidecar.global_index import GlobalIndex

from .test_fleet_faults import assert_peer_serves_the_miss
from .test_sidecar_process import poll, prompt

HOST_A, HOST_B, ME = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.9:1"
# Eight fixed key roots: their slots fall on every shard of a three-primary cluster.
TAGS = [hashlib.md5(f"root-{i}".encode()).hexdigest() for i in range(8)]
# Tests of what the index answers (not of how fast) give each call a generous deadline:
# the request path's 50 ms default is about latency, and the first call on a cluster
# client (slot map, connections, script per shard) can exceed it on a busy machine.
FUNCTIONAL_DEADLINE_S = 2.0
# The outage test's Redis socket timeout: many times its request deadline (0.2 s).
REDIS_SOCKET_TIMEOUT_S = 5.0


def hashes(n: int, salt: str = "") -> list[str]:
    return [hashlib.md5(f"{salt}{i}".encode()).hexdigest() for i in range(n)]


def run(coro):
    return asyncio.run(coro)


def client(cluster) -> redis_sync.RedisCluster:
    return redis_sync.RedisCluster.from_url(cluster.url)


def shard_of(cluster, tag: str) -> int:
    """Index in cluster.nodes of the shard holding this root's keys."""
    rc = client(cluster)
    try:
        return cluster.node_for_port(rc.get_node_from_key(f"kvt:{{{tag}}}:x").port)
    finally:
        rc.close()


def script_calls(cluster) -> tuple[int, int]:
    """(EVALSHA, EVAL) calls summed over every shard."""
    evalsha = evals = 0
    for node in cluster.nodes:
        raw = node.command("INFO", "commandstats").decode()
        for line in raw.splitlines():
            if line.startswith(("cmdstat_evalsha:", "cmdstat_eval:")):
                calls = int(line.split("calls=")[1].split(",")[0])
                if line.startswith("cmdstat_evalsha:"):
                    evalsha += calls
                else:
                    evals += calls
    return evalsha, evals


def test_roots_spread_over_shards_and_each_prompt_is_answered_by_one_script_call(redis_cluster):
    async def go():
        a = GlobalIndex(redis_cluster.url, HOST_A, timeout_s=FUNCTIONAL_DEADLINE_S, cluster=True)
        b = GlobalIndex(redis_cluster.url, HOST_B, timeout_s=FUNCTIONAL_DEADLINE_S, cluster=True)
        me = GlobalIndex(redis_cluster.url, ME, timeout_s=FUNCTIONAL_DEADLINE_S, cluster=True)
        # Root i: A holds 10 + i blocks, B holds 30 + 2i; a 125-block (2,000-token) prompt.
        for i, tag in enumerate(TAGS):
            a.register(tag, hashes(10 + i))
            b.register(tag, hashes(30 + 2 * i))
        assert await a.flush() and await b.flush()
        holding = [i for i in range(len(redis_cluster.nodes)) if redis_cluster.dbsize(i) > 0]
        assert len(holding) >= 2, f"all keys on one shard: {[redis_cluster.dbsize(i) for i in range(3)]}"
        assert {shard_of(redis_cluster, t) for t in TAGS} == set(holding)

        prompt_hashes = hashes(125)
        for tag in TAGS:  # first call per shard may load the script (EVALSHA miss -> EVAL)
            await me.longest_prefix(tag, prompt_hashes)
        before = script_calls(redis_cluster)
        for i, tag in enumerate(TAGS):
            answer = await me.longest_prefix(tag, prompt_hashes)
            assert answer is not None and answer.matched_blocks == 30 + 2 * i and answer.hosts == [HOST_B]
            # B asks: A's shorter run is the longest prefix another host holds.
            from_b = await b.longest_prefix(tag, prompt_hashes)
            assert from_b.matched_blocks == 10 + i and from_b.hosts == [HOST_A]
        after = script_calls(redis_cluster)
        assert (after[0] - before[0], after[1] - before[1]) == (2 * len(TAGS), 0)

        # A prompt that diverges after 5 blocks matches 5, whoever holds more.
        diverged = hashes(5) + hashes(20, salt="other")
        assert (await me.longest_prefix(TAGS[0], diverged)).matched_blocks == 5
        assert await me.longest_prefix(hashlib.md5(b"unknown").hexdigest(), prompt_hashes) is None
        assert me.stats["lookup_errors"] == 0 and a.stats["register_errors"] == 0
        for idx in (a, b, me):
            await idx.close()
    run(go())


def test_expired_host_entries_stop_matching_and_expired_keys_leave_the_shards(redis_cluster):
    async def go():
        old = GlobalIndex(redis_cluster.url, HOST_A, ttl_s=1, timeout_s=FUNCTIONAL_DEADLINE_S, cluster=True)
        fresh = GlobalIndex(redis_cluster.url, HOST_B, ttl_s=600, timeout_s=FUNCTIONAL_DEADLINE_S, cluster=True)
        me = GlobalIndex(redis_cluster.url, ME, timeout_s=FUNCTIONAL_DEADLINE_S, cluster=True)
        for tag in TAGS[:4]:
            old.register(tag, hashes(8))
            fresh.register(tag, hashes(3))
        old.register(TAGS[4], hashes(6))  # only the short-lived host holds this root
        assert await old.flush() and await fresh.flush()
        assert (await me.longest_prefix(TAGS[0], hashes(8))).matched_blocks == 8
        deadline = time.monotonic() + 6
        while True:
            answers = [await me.longest_prefix(t, hashes(8)) for t in TAGS[:5]]
            if all(a is not None and a.hosts == [HOST_B] for a in answers[:4]) and answers[4] is None:
                break
            assert time.monotonic() < deadline, f"entries did not expire: {answers}"
            await asyncio.sleep(0.2)
        assert all(a.matched_blocks == 3 for a in answers[:4])
        rc = client(redis_cluster)
        try:
            # The key TTL, not only the field expiry, cleans up: the only-old root's keys go.
            poll(lambda: rc.exists(*[f"kvt:{{{TAGS[4]}}}:{h}" for h in hashes(6)]) == 0, timeout_s=5)
        finally:
            rc.close()
        for idx in (old, fresh, me):
            await idx.close()
    run(go())


def test_deregistration_withdraws_the_hosts_entries_and_membership_on_every_shard(redis_cluster):
    async def go():
        a = GlobalIndex(redis_cluster.url, HOST_A, timeout_s=FUNCTIONAL_DEADLINE_S, cluster=True)
        b = GlobalIndex(redis_cluster.url, HOST_B, timeout_s=FUNCTIONAL_DEADLINE_S, cluster=True)
        me = GlobalIndex(redis_cluster.url, ME, timeout_s=FUNCTIONAL_DEADLINE_S, cluster=True)
        for tag in TAGS:
            a.register(tag, hashes(12))
            b.register(tag, hashes(4))
        assert await a.flush() and await b.flush()
        for idx in (a, b, me):
            await idx.heartbeat()
        assert {HOST_A, HOST_B} <= me._members
        await a.deregister()
        await me.heartbeat()
        assert HOST_A not in me._members and HOST_B in me._members
        for tag in TAGS:  # every shard lost A's field; B's shorter entries remain
            answer = await me.longest_prefix(tag, hashes(12))
            assert answer.hosts == [HOST_B] and answer.matched_blocks == 4
        rc = client(redis_cluster)
        try:
            assert not any(rc.hexists(f"kvt:{{{t}}}:{h}", HOST_A) for t in TAGS for h in hashes(12))
        finally:
            rc.close()
        for idx in (a, b, me):
            await idx.close()
    run(go())


def test_a_sigkilled_shard_is_a_miss_without_an_exception_and_the_index_recovers(redis_cluster):
    async def go():
        a = GlobalIndex(redis_cluster.url, HOST_A, timeout_s=FUNCTIONAL_DEADLINE_S, cluster=True)
        # A socket timeout far beyond the request path's deadline: a call that waited
        # for the dead shard's socket would take it; one cut at its deadline does not.
        me = GlobalIndex(redis_cluster.url, ME, timeout_s=0.2, cluster=True, socket_timeout_s=REDIS_SOCKET_TIMEOUT_S)
        assert me.socket_timeout_s == REDIS_SOCKET_TIMEOUT_S
        for tag in TAGS:
            a.register(tag, hashes(20))
        assert await a.flush()
        shards = {tag: shard_of(redis_cluster, tag) for tag in TAGS}
        # Never the startup node (0): clients created later still bootstrap from it.
        victim = next(s for s in shards.values() if s != 0)
        dead = [t for t in TAGS if shards[t] == victim]
        live = [t for t in TAGS if shards[t] != victim]
        assert dead and live
        # Healthy first: every tag hits. The first calls also open the client's
        # connections and learn the slots, which a busy machine may not do within the
        # 0.2 s request deadline: poll (with a deadline) until each answers.
        for tag in TAGS:
            deadline = time.monotonic() + 30
            while (answer := await me.longest_prefix(tag, hashes(20))) is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert answer is not None and answer.matched_blocks == 20

        redis_cluster.kill(victim)
        # Request path during the outage: every call returns (a hint or nothing) without
        # waiting out the dead shard's socket timeout, and never a wrong answer;
        # registrations queue without raising.
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            for tag in TAGS:
                t0 = time.monotonic()
                answer = await me.longest_prefix(tag, hashes(20))
                assert time.monotonic() - t0 < me.socket_timeout_s
                assert answer is None or (tag in live and answer.matched_blocks == 20 and answer.hosts == [HOST_A])
            a.register(dead[0], hashes(20, salt="during"))
            await asyncio.sleep(0.05)
        assert me.stats["lookup_errors"] > 0  # the dead shard was really asked
        redis_cluster.wait_marked_failed(victim)
        # Roots on the surviving shards answer again once the breaker lets a call through.
        live_answer = await poll_async(lambda: me.longest_prefix(live[0], hashes(20)))
        assert live_answer.matched_blocks == 20
        # Shards that lost their script cache during the outage (restarted, failed over)
        # need it again: loading it must not need every primary (SCRIPT LOAD fans out
        # to all of them and fails while one is down, costing a miss and a breaker trip).
        for node in redis_cluster.nodes:
            if node.running:
                assert node.command("SCRIPT", "FLUSH").startswith(b"+OK")
        late = GlobalIndex(redis_cluster.url, "10.0.0.8:1", timeout_s=0.5, cluster=True)
        late_answer = await late.longest_prefix(live[0], hashes(20))  # the first call answers
        assert late_answer is not None and late_answer.matched_blocks == 20 and late_answer.hosts == [HOST_A]
        assert late.stats["lookup_errors"] == 0
        await late.close()

        redis_cluster.restart(victim)  # back on its port with its slots, empty
        await poll_async(a.flush)  # the queued registrations land once the shard is back
        for tag in dead:
            a.register(tag, hashes(20))
        await poll_async(a.flush)
        for tag in dead:
            answer = await poll_async(lambda: me.longest_prefix(tag, hashes(20)))
            assert answer.matched_blocks == 20 and answer.hosts == [HOST_A]
        answer = await poll_async(lambda: me.longest_prefix(dead[0], hashes(20, salt="during")))
        assert answer.matched_blocks == 20
        for idx in (a, me):
            await idx.close()
    run(go())


async def poll_async(fn, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = await fn()
        if value:
            return value
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        await asyncio.sleep(0.05)


def test_a_miss_on_one_sidecar_is_served_by_the_peer_found_through_the_cluster_index(
        spawn, oracle, redis_cluster, secret_file):
    a = spawn("a", "127.0.0.2", redis_cluster.url, secret_file, redis_cluster=True)
    b = spawn("b", "127.0.0.3", redis_cluster.url, secret_file, redis_cluster=True)
    ca, cb = SidecarClient(a.socket), SidecarClient(b.socket)
    rc = client(redis_cluster)
    try:
        for tenant in ("acme", "globex", "initech"):
            assert_peer_serves_the_miss(ca, cb, a.peer, rc, oracle, tenant, prompt(200, seed=len(tenant)))
        assert b.stats("acme")["hits_by_tier"]["peer"] == 1
        # Graceful shutdown withdraws A's entries from the cluster.
        root, tokens = oracle.root("acme"), prompt(200, seed=4)
        last = block_hashes(root, tokens, 16)[-1].hex()
        a.stop()
        poll(lambda: not rc.hexists(f"kvt:{{{root.digest().hex()}}}:{last}", a.peer))
    finally:
        rc.close()


def _admin(node) -> redis_sync.Redis:
    """A plain (non-cluster) connection to one shard, for the reshard's own commands."""
    return redis_sync.Redis(host=node.host, port=node.port)


def _move_slot(cluster, slot: int, src: int, dst: int, between=None) -> None:
    """Move `slot` from shard `src` to shard `dst` the way `redis-cli --cluster reshard`
    does: IMPORTING/MIGRATING, MIGRATE its keys, then SETSLOT NODE on every shard.
    `between()` runs while the slot is half moved (clients get ASK redirections)."""
    source, target = _admin(cluster.nodes[src]), _admin(cluster.nodes[dst])
    try:
        src_id = source.execute_command("CLUSTER", "MYID").decode()
        dst_id = target.execute_command("CLUSTER", "MYID").decode()
        target.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        source.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)

        def migrate(limit: int) -> None:
            keys = source.execute_command("CLUSTER", "GETKEYSINSLOT", slot, limit)
            if keys:
                source.execute_command("MIGRATE", cluster.host, cluster.nodes[dst].port, "", 0, 5000, "KEYS", *keys)
        total = source.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot)
        migrate(max(1, total // 2))
        if between is not None:
            between()
        migrate(1 << 20)
        for node in cluster.nodes:
            with _admin(node) as admin:
                admin.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    finally:
        source.close()
        target.close()


def test_a_slot_moved_between_shards_keeps_lookups_and_registrations_working(redis_cluster):
    """A reshard under live traffic: while the root's slot is half moved a lookup is the
    right answer or a miss, never a wrong one nor an exception; once moved, lookups and
    new registrations work against the new owner without a restart."""
    async def go():
        a = GlobalIndex(redis_cluster.url, HOST_A, timeout_s=FUNCTIONAL_DEADLINE_S, cluster=True)
        me = GlobalIndex(redis_cluster.url, ME, timeout_s=FUNCTIONAL_DEADLINE_S, cluster=True)
        tag = TAGS[0]
        a.register(tag, hashes(16))
        assert await a.flush()
        assert (await me.longest_prefix(tag, hashes(16))).matched_blocks == 16
        src = shard_of(redis_cluster, tag)
        dst = (src + 1) % len(redis_cluster.nodes)
        with _admin(redis_cluster.nodes[src]) as admin:
            slot = admin.execute_command("CLUSTER", "KEYSLOT", f"kvt:{{{tag}}}:x")
        during: list = []
        loop = asyncio.get_running_loop()

        def half_moved() -> None:
            # this runs in the event loop's thread: ask from a helper thread and wait
            import concurrent.futures
            with concurrent.futures.ThreadPoolExecutor(1) as ex:
                during.append(ex.submit(asyncio.run, _ask(redis_cluster.url, tag)).result(30))

        try:
            await loop.run_in_executor(None, _move_slot, redis_cluster, slot, src, dst, half_moved)
            assert during and during[0] in (None, 16), during  # right, or a miss: never another length
            assert shard_of(redis_cluster, tag) == dst
            answer = await me.longest_prefix(tag, hashes(16))
            assert answer is not None and answer.matched_blocks == 16 and answer.hosts == [HOST_A]
            a.register(tag, hashes(24))  # a write to the slot's new owner
            assert await a.flush()
            assert (await me.longest_prefix(tag, hashes(24))).matched_blocks == 24
            assert redis_cluster.dbsize(dst) > 0
        finally:
            if shard_of(redis_cluster, tag) != src:  # the session's cluster goes back as it was
                await loop.run_in_executor(None, _move_slot, redis_cluster, slot, dst, src, None)
        assert (await me.longest_prefix(tag, hashes(24))).matched_blocks == 24
        for idx in (a, me):
            await idx.close()
    run(go())


async def _ask(url: str, tag: str) -> int | None:
    """One lookup from a fresh index client (its own slot map), as another sidecar."""
    other = GlobalIndex(url, "10.0.0.8:1", timeout_s=FUNCTIONAL_DEADLINE_S, cluster=True)
    try:
        answer = await other.longest_prefix(tag, hashes(16))
        return None if answer is None else answer.matched_blocks
    finally:
        await other.close()
