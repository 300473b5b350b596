"""Which announced blocks the connector withdraws from vLLM's KV event stream: the
sidecar's removals after their store, all of them when the sidecar is another process,
the oldest past the bound — never one stored again after its removal was logged."""
from __future__ import annotations

from kvtier_vllm.announced import Announced

KV = [bytes([i]) * 16 for i in range(8)]
"""Key-chain hashes of eight kvtier blocks of one prompt."""
VLLM = [101, 102, 103, 104]
"""vLLM's hashes of its four blocks: two kvtier blocks in each."""


def test_a_removal_after_the_store_withdraws_the_vllm_block_holding_it():
    a = Announced()
    assert a.add("inst-1", 10, KV, VLLM, 2) == [] and len(a) == 8 and a.cursor == 10
    # the log from position 10: an unrelated block, then kvtier block 5 (in vLLM block 2)
    assert a.removed(10, [b"x" * 16, KV[5]]) == [103]
    assert len(a) == 7
    assert a.removed(12, [KV[5]]) == []  # named twice: withdrawn once


def test_a_removal_logged_before_the_store_is_of_an_older_copy():
    a = Announced()
    a.add("inst-1", 20, KV[:2], VLLM[:1], 2)
    assert a.removed(18, [KV[0], KV[1]]) == []      # positions 18 and 19: before the store at 20
    assert a.removed(19, [KV[0], KV[1]]) == [101]   # position 20 names KV[1]: after it
    assert len(a) == 1


def test_blocks_past_the_last_whole_vllm_block_are_not_tracked():
    a = Announced()
    a.add("inst-1", 0, KV[:5], VLLM[:2], 2)  # kvtier block 4 lies in a vLLM block not announced
    assert len(a) == 4 and a.removed(0, [KV[4]]) == []


def test_another_sidecar_process_withdraws_everything_announced_before():
    a = Announced()
    a.add("inst-1", 5, KV[:4], VLLM[:2], 2)
    withdrawn = a.add("inst-2", 0, KV[4:6], VLLM[2:3], 2)
    assert sorted(set(withdrawn)) == [101, 102] and len(a) == 2 and a.instance == "inst-2" and a.cursor == 0


def test_past_the_bound_the_oldest_announcement_is_withdrawn():
    a = Announced(limit=3)
    a.add("inst-1", 0, KV[:2], [1, 2], 1)
    assert a.add("inst-1", 0, KV[2:4], [3, 4], 1) == [1]
    assert len(a) == 3 and a.removed(0, [KV[0]]) == []
    # announcing a block again makes it the newest
    a.add("inst-1", 0, KV[1:2], [2], 1)
    assert a.add("inst-1", 0, KV[4:5], [5], 1) == [3]


def test_clear_forgets_every_block_and_the_position():
    a = Announced()
    a.add("inst-1", 7, KV, VLLM, 2)
    assert sorted(set(a.clear())) == VLLM and len(a) == 0 and a.cursor is None
