"""Hits and store tickets belong to the engine connection (or TP group) that made them:
a store commits only when every rank wrote, and a commit, abort or release from anyone
else is refused and changes nothing."""
import re

import numpy as np
import pytest

from kvtier_sidecar.client import EngineHit, Miss, SidecarClient, root_payload
from kvtier_sidecar.engine_proto import EngineOp

from .test_sidecar_process import prompt, seed_cache

BB = 8192


def _admitted(client: SidecarClient, root, tokens) -> None:
    for _ in range(2):  # two sightings: the store is admitted (rule 8)
        client.release(client.lookup(root, tokens))


def _begin(client: SidecarClient, root, tokens, tp: int = 1, rank: int = 0) -> int:
    answer, _ = client._call_locked(EngineOp.STORE_BEGIN, {"root": root_payload(root), "tp": tp, "rank": rank}, tokens)
    assert answer["ticket"]
    return int(answer["ticket"])


def _refused(client: SidecarClient, op: EngineOp, payload: dict) -> str:
    with pytest.raises(ValueError) as err:
        client._call_locked(op, payload)
    return str(err.value)


def _pinned(sc) -> float:
    status, body = sc.get("/metrics")
    return float(re.search(rb"^kvtier_pinned_hits(?:\{[^}]*\})? (\S+)$", body, re.M).group(1))


def test_tp_store_with_a_rank_that_never_wrote_is_never_published(spawn, oracle):
    sc = spawn()
    c = SidecarClient(sc.socket)
    root, tokens = oracle.root("tp"), prompt(64, seed=5)
    _admitted(c, root, tokens)
    ticket = _begin(c, root, tokens, tp=2, rank=0)
    assert c._call_locked(EngineOp.STORE_COMMIT, {"ticket": ticket, "rank": 0})[0]["committed"]
    # Rank 7 of a TP=2 store: not a rank of it, and not begun here.
    assert "not begun by this engine connection" in _refused(c, EngineOp.STORE_COMMIT, {"ticket": ticket, "rank": 7})
    assert "not begun" in _refused(c, EngineOp.STORE_COMMIT, {"ticket": ticket, "rank": 1})
    assert isinstance(c.lookup(root, tokens), Miss)  # rank 1 never wrote: nothing served


def test_another_connection_cannot_commit_abort_or_join_a_tickets_rank(spawn, oracle):
    sc = spawn()
    owner, other = SidecarClient(sc.socket), SidecarClient(sc.socket)
    root, tokens = oracle.root("t"), prompt(64, seed=6)
    kv = oracle.kv(root, tokens)
    _admitted(owner, root, tokens)
    ticket = _begin(owner, root, tokens)
    assert "not begun by this engine connection" in _refused(other, EngineOp.STORE_COMMIT, {"ticket": ticket, "rank": 0})
    assert "another engine connection" in _refused(other, EngineOp.STORE_ABORT, {"ticket": ticket})
    with pytest.raises(ValueError, match="begun by another engine connection"):
        _begin(other, root, tokens)  # the same prompt's rank 0 is the owner's
    assert isinstance(other.lookup(root, tokens), Miss)  # the foreign commit published nothing
    # The owner's ticket is intact: it writes, commits, and the blocks serve exactly.
    owner.close()
    again = SidecarClient(sc.socket)
    seed_cache(again, oracle, "t", tokens)
    hit = again.lookup(root, tokens)
    assert isinstance(hit, EngineHit)
    dst = np.zeros(len(hit.blocks) * BB, np.uint8)
    again.materialize(hit, dst)
    assert np.array_equal(dst, kv[: len(dst)])


def test_another_connection_cannot_release_a_hit_it_does_not_hold(spawn, oracle):
    sc = spawn()
    owner, other = SidecarClient(sc.socket), SidecarClient(sc.socket)
    tokens = prompt(64, seed=7)
    seed_cache(owner, oracle, "t", tokens)
    hit = owner.lookup(oracle.root("t"), tokens)
    assert isinstance(hit, EngineHit) and _pinned(sc) == 1
    assert "another engine connection" in _refused(other, EngineOp.RELEASE, {"hit": hit.hit_id})
    assert _pinned(sc) == 1  # still pinned: its blocks cannot be evicted under the owner
    owner.release(hit)
    assert _pinned(sc) == 0
