"""An engine maps the sidecar's arena by its shared-memory name. A second sidecar
started with the same identity (same namespace and pod name) on the same host
refuses to start while the first lives (`identity_lock`), so it never replaces the
segment under that name; and should a segment under the name ever be a stranger's,
an engine attaching to it refuses it by its tag (rule: fault-is-a-miss)."""
import os

import numpy as np
import pytest

from kvtier_sidecar.arena import Arena, ArenaError
from kvtier_sidecar.client import EngineHit, SidecarClient

from kvtier_testenv.polling import wait_for

from .test_sidecar_process import prompt, seed_cache

BB = 8192


def test_a_twin_with_the_same_identity_refuses_to_start_and_engines_keep_their_sidecars_bytes(spawn, oracle):
    a = spawn("a", "127.0.0.2", pod_name="twin")
    first = SidecarClient(a.socket)
    root, tokens = oracle.root("t"), prompt(120)
    seed_cache(first, oracle, "t", tokens)
    expected = oracle.kv(root, tokens)
    with pytest.raises(RuntimeError, match="another kvtier sidecar with identity"):
        spawn("b", "127.0.0.3", pod_name="twin")  # same identity: would take the segment's name
    late = SidecarClient(a.socket)  # an engine (re)connecting to `a` now
    for client in (late, first):
        hit = client.lookup(root, tokens)
        assert isinstance(hit, EngineHit) and hit.matched_tokens == 112
        dst = np.zeros(7 * BB, np.uint8)
        client.materialize(hit, dst)
        assert np.array_equal(dst, expected[: 7 * BB])
        client.release(hit)


def test_attach_refuses_a_segment_whose_tag_is_not_its_creators():
    owner = Arena.create(f"kvt-test-tag-{os.getpid()}", 4, BB)
    try:
        same = Arena.attach(owner.name, owner.size, BB, owner.tag)
        assert same.tag == owner.tag and same.array.nbytes == 4 * BB
        same.close()
        with pytest.raises(ArenaError, match="another sidecar"):
            Arena.attach(owner.name, owner.size, BB, bytes(len(owner.tag)))
    finally:
        owner.close()


def _mapped(name: str) -> bool:
    """This process maps the segment `name` (unlinked or not)."""
    with open("/proc/self/maps") as maps:
        return any(f"/dev/shm/{name}" in line for line in maps)


def test_an_engine_unmaps_a_dead_sidecars_arena_so_its_restart_finds_room(spawn, oracle):
    """A pod's memory-backed volume is sized for one arena. When the sidecar dies
    (SIGKILL: it unlinks nothing), the engine's client must drop the dead sidecar's
    arena as soon as a reconnect finds nobody, or the restarted sidecar can never
    reserve its own (ENOSPC) and the pod stays without a cache. Then the restart maps
    afresh and serves checked hits again."""
    a = spawn("a", "127.0.0.2", pod_name="phoenix")
    client = SidecarClient(a.socket)
    root, tokens = oracle.root("t"), prompt(120)
    seed_cache(client, oracle, "t", tokens)
    name, instance = client.info["shm_name"], client.info["instance"]
    assert _mapped(name)
    a.kill()

    def released() -> bool:
        return not client.lookup(root, tokens) and client.arena is None and not _mapped(name)
    wait_for("the client to unmap the dead sidecar's arena", released, 30, 0.1)

    a.start()  # the same identity restarted, as kubelet restarts a container

    def reconnected() -> bool:
        """The client retries no sooner than its backoff after the last failed dial,
        so the restart is seen by a later call, not necessarily the first."""
        client.lookup(root, tokens)
        return client.info.get("instance", instance) != instance
    wait_for("the client to reconnect to the restarted sidecar", reconnected, 30, 0.1)
    seed_cache(client, oracle, "t", tokens)
    assert _mapped(name)
    hit = client.lookup(root, tokens)
    assert hit and hit.matched_tokens == 112
    dst = np.zeros(7 * BB, np.uint8)
    client.materialize(hit, dst)
    assert np.array_equal(dst, oracle.kv(root, tokens)[: 7 * BB])
    client.release(hit)


def test_a_restarted_sidecar_waits_for_room_in_its_volume_then_fails_clearly(monkeypatch):
    """`create_arena` rides out ENOSPC (the predecessor's arena still mapped by the
    engine) until its deadline; any other failure, and ENOSPC past the deadline, raise
    the arena's own error at once."""
    import asyncio
    import errno

    from kvtier_sidecar import main as sidecar_main

    monkeypatch.setattr(sidecar_main, "ARENA_SPACE_POLL_S", 0.01)

    def run(err: int, failures: int | None, wait_s: float) -> tuple[object, int]:
        """create_arena over a stand-in Arena.create failing with `err` its first
        `failures` calls (None: every call): (what it returned, calls made)."""
        calls = []

        def create(name, slots, block_bytes):
            calls.append(name)
            if failures is None or len(calls) <= failures:
                raise ArenaError(f"arena {name}: {os.strerror(err)}") from OSError(err, os.strerror(err))
            return "arena"
        monkeypatch.setattr(sidecar_main.Arena, "create", create)
        try:
            return asyncio.run(sidecar_main.create_arena("kvt-x", 4, BB, wait_s=wait_s)), len(calls)
        except ArenaError as exc:
            return exc, len(calls)

    assert run(errno.ENOSPC, 2, wait_s=10) == ("arena", 3)  # room came: it waited it out
    gave_up, n = run(errno.ENOSPC, None, wait_s=0.05)        # never: the deadline's error
    assert isinstance(gave_up, ArenaError) and "No space left" in str(gave_up) and n >= 2
    refused, n = run(errno.EACCES, None, wait_s=10)          # another failure: at once
    assert isinstance(refused, ArenaError) and "Permission denied" in str(refused) and n == 1
