"""A stored block is visible only after its bytes are proven written by the store that
reserved it: never a predecessor's ticket, never the slot's previous contents, never
KV of another length than the prompt's full blocks. Against a real sidecar process."""
import socket
import struct

import numpy as np
import pytest

from kvtier_sidecar.client import EngineHit, Miss, SidecarClient, StaleHit
from kvtier_sidecar.engine_proto import FRAME, EngineOp, decode_header, encode, split_body
from kvtier_sidecar.engine_server import FRAME_BODY_TIMEOUT_S

from .test_sidecar_process import BB, poll, prompt, seed_cache

# SyntheticOracle's block: (layers 2, K|V, kv heads 2, 16 tokens, head_dim 16) fp32.
ROW_BYTES = 16 * 4
ROWS = 2 * 2 * 2
TOKENS = 16


def _admitted(client: SidecarClient, root, tokens) -> None:
    for _ in range(2):  # two sightings: the store is admitted
        client.release(client.lookup(root, tokens))


def _reconnected(client: SidecarClient, root, old_instance: str) -> None:
    """Calls fault on the dead connection, then reconnect past the client's back-off."""
    probe = prompt(20, seed=99)
    poll(lambda: client.lookup(root, probe) is not None and client.info.get("instance") != old_instance)


def _write(res, kv: np.ndarray) -> None:
    """What an engine does between begin_store and commit_store (tp 1)."""
    for i, slot in enumerate(res.slots):
        block = res.first_block + i
        res.arena.slot_array(slot)[:] = kv[block * BB:(block + 1) * BB]


def test_a_reservation_from_before_a_sidecar_restart_never_commits_the_successors_store(spawn, oracle):
    sc = spawn()
    c = SidecarClient(sc.socket)
    root, p1, p2 = oracle.root("t"), prompt(100, seed=1), prompt(100, seed=2)
    _admitted(c, root, p1)
    r1 = c.begin_store(root, p1)
    assert r1 is not None
    old_instance = c.info["instance"]
    sc.kill()
    sc.start()  # a new sidecar process on the same socket: ids start again
    _reconnected(c, root, old_instance)
    _admitted(c, root, p2)
    r2 = c.begin_store(root, p2)
    assert r2 is not None and r2.ticket != r1.ticket
    # The engine finishes its old store: refused without asking, nothing published.
    assert c.commit_store(r1) is False
    # A client that sends the stale ticket anyway is told it is another process's.
    with pytest.raises(ValueError, match="another sidecar process"):
        c._call_locked(EngineOp.STORE_COMMIT, {"ticket": r2.ticket, "rank": 0, "instance": old_instance})
    assert isinstance(c.lookup(root, p2), Miss)  # p2 was never written: no hit of its slots
    # The live reservation still works: written, committed, served byte for byte.
    kv2 = oracle.kv(root, p2)
    _write(r2, kv2)
    assert c.commit_store(r2) is True
    hit = c.lookup(root, p2)
    assert isinstance(hit, EngineHit) and hit.matched_tokens == 96
    dst = np.zeros(6 * BB, np.uint8)
    c.materialize(hit, dst)
    assert np.array_equal(dst, kv2[: 6 * BB])


def test_a_hit_from_before_a_reconnect_is_refused_not_copied(spawn, oracle):
    sc = spawn()
    c = SidecarClient(sc.socket)
    root, tokens = oracle.root("t"), prompt(100)
    seed_cache(c, oracle, "t", tokens)
    hit = c.lookup(root, tokens)
    assert isinstance(hit, EngineHit)
    c.close()  # the sidecar releases the connection's pins: the slots may be reused
    with pytest.raises(StaleHit):
        c.materialize(hit, np.zeros(6 * BB, np.uint8))
    again = c.lookup(root, tokens)  # a fresh lookup pins again and copies exactly
    dst = np.zeros(6 * BB, np.uint8)
    c.materialize(again, dst)
    assert np.array_equal(dst, oracle.kv(root, tokens)[: 6 * BB])


def _freed_slots_of_another_tenant(sc, c: SidecarClient, oracle) -> None:
    """Store tenant `a`, then drop it: its slots are free and still hold its bytes."""
    seed_cache(c, oracle, "a", prompt(100, seed=11))
    assert sc.stats()["cache"]["blocks_used"] == 6
    status, body = sc.post("/cache/invalidate", {"model_version": oracle.root("a").weights_version})
    assert status == 202, body
    poll(lambda: sc.stats()["cache"]["blocks_used"] == 0)


def test_a_store_committed_without_being_written_publishes_nothing_not_the_slots_old_bytes(spawn, oracle):
    sc = spawn(dram_capacity_bytes=8 * BB)
    c = SidecarClient(sc.socket)
    _freed_slots_of_another_tenant(sc, c, oracle)
    root, tokens = oracle.root("b"), prompt(100, seed=12)
    _admitted(c, root, tokens)
    res = c.begin_store(root, tokens)
    assert res is not None and len(res.slots) == 6
    assert c.commit_store(res) is False  # nothing written: nothing committed
    assert isinstance(c.lookup(root, tokens), Miss)
    assert sc.stats()["sidecar"]["store_unwritten_blocks"] == 6


def test_only_blocks_whose_every_row_was_written_are_published(spawn, oracle):
    sc = spawn(dram_capacity_bytes=8 * BB)
    c = SidecarClient(sc.socket)
    _freed_slots_of_another_tenant(sc, c, oracle)
    root, tokens = oracle.root("b"), prompt(100, seed=14)
    kv = oracle.kv(root, tokens)
    _admitted(c, root, tokens)
    res = c.begin_store(root, tokens)
    assert res is not None and len(res.slots) == 6
    # Rows are (layer, K|V, head); row 6 is layer 1's V of head 0.
    saved = res.arena.slot_array(res.slots[3]).reshape(ROWS, TOKENS, ROW_BYTES)[6].copy()  # as stamped
    _write(res, kv)
    # Block 3's layer 1 V was never written: the copy skipped it.
    res.arena.slot_array(res.slots[3]).reshape(ROWS, TOKENS, ROW_BYTES)[6] = saved
    assert c.commit_store(res) is True  # blocks 0-2 were written whole
    hit = c.lookup(root, tokens)
    assert isinstance(hit, EngineHit) and hit.matched_tokens == 48
    dst = np.zeros(3 * BB, np.uint8)
    c.materialize(hit, dst)
    assert np.array_equal(dst, kv[: 3 * BB])
    c.release(hit)
    assert sc.stats()["sidecar"]["store_unwritten_blocks"] == 3


def test_a_tp_store_whose_rank_committed_without_writing_its_heads_publishes_nothing(spawn, oracle):
    sc = spawn(dram_capacity_bytes=8 * BB)
    ranks = [SidecarClient(sc.socket), SidecarClient(sc.socket)]
    _freed_slots_of_another_tenant(sc, ranks[0], oracle)
    root, tokens = oracle.root("b"), prompt(100, seed=15)
    kv = oracle.kv(root, tokens)
    _admitted(ranks[0], root, tokens)
    shard = kv.reshape(6, 2, 2, 2, TOKENS * ROW_BYTES)[:, :, :, 0::2].copy()  # rank 0's heads of each block
    res = [c.begin_store(root, tokens, tp=2, rank=r) for r, c in enumerate(ranks)]
    assert all(r is not None for r in res) and res[0].slots == res[1].slots
    ranks[0]._write_slots(res[0].arena, res[0].slots, 0, shard.reshape(-1), 2, 0)
    assert ranks[0].commit_store(res[0]) and ranks[1].commit_store(res[1]) is False  # rank 1 wrote nothing
    assert isinstance(ranks[0].lookup(root, tokens), Miss)
    assert sc.stats()["sidecar"]["store_unwritten_blocks"] == 6


def test_kv_that_is_not_exactly_the_prompts_full_blocks_is_refused_and_stores_nothing(spawn, oracle):
    sc = spawn()
    c = SidecarClient(sc.socket)
    root, tokens, other = oracle.root("t"), prompt(100, seed=3), prompt(200, seed=4)
    kv = oracle.kv(root, tokens)
    _admitted(c, root, tokens)
    for wrong in (np.concatenate([kv, kv]), oracle.kv(root, other), kv[:-BB], kv[:-1]):
        with pytest.raises(ValueError, match="full blocks"):
            c.store(root, tokens, wrong)
    assert isinstance(c.lookup(root, tokens), Miss)
    assert sc.stats()["cache"]["blocks_used"] == 0
    assert c.store(root, tokens, kv) is True


def _raw(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    return s


def _ask(s: socket.socket, op: EngineOp, payload: dict) -> dict:
    s.sendall(encode(op, 1, payload))
    head = b""
    while len(head) < FRAME.size:
        head += s.recv(FRAME.size - len(head))
    body_len, _, _, json_len = decode_header(head)
    rest = b""
    while len(rest) < body_len - 4:
        rest += s.recv(body_len - 4 - len(rest))
    return split_body(rest, json_len)[0]


@pytest.mark.parametrize("payload", [
    {"loaded_bytes": 1e30}, {"loaded_bytes": 2 ** 60}, {"loaded_bytes": True},
    {"load_errors": 2 ** 40}, {"loaded_bytes": 1.0},
])
def test_an_implausible_engine_report_is_refused_and_counts_nothing(spawn, payload):
    sc = spawn()
    s = _raw(sc.socket)
    answer = _ask(s, EngineOp.REPORT, payload)
    assert "error" in answer and "report" in answer["error"]
    assert "error" not in _ask(s, EngineOp.REPORT, {"loaded_bytes": 4096})  # same connection, still served
    counters = sc.stats()["sidecar"]
    assert counters.get("engine_loaded_bytes") == 4096 and counters.get("engine_load_errors", 0) == 0


def test_a_frame_that_announces_more_than_it_sends_is_closed_while_others_are_served(spawn, oracle):
    sc = spawn()
    s = _raw(sc.socket)
    s.sendall(struct.pack("<IBII", 8 << 20, int(EngineOp.LOOKUP), 1, 2) + b"{}" + b"x" * 8)
    c = SidecarClient(sc.socket)  # another engine connection is answered meanwhile
    assert isinstance(c.lookup(oracle.root("t"), prompt(40)), Miss)
    s.settimeout(FRAME_BODY_TIMEOUT_S * 4)
    assert s.recv(1) == b""  # the sidecar hung up on the frame that never came whole (a deadline, not a figure)
    assert isinstance(c.lookup(oracle.root("t"), prompt(40)), Miss)  # and still serves
