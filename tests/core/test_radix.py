"""The token radix index: block-aligned matching, edge splits, pins, leaf-first eviction."""
from __future__ import annotations

import numpy as np
import pytest

from kvtier.keys import KeyRoot, block_hashes
from kvtier.radix import PrefixIndex

B = 16
ROOT = KeyRoot("t1", "m", "w1", "fp16", "rope", "attn")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def toks(*runs: tuple[int, int]) -> bytes:
    """Canonical bytes of the concatenated token ranges."""
    return np.concatenate([np.arange(a, b, dtype=np.uint32) for a, b in runs]).astype("<u4").tobytes()


class Slots:
    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def insert(ix: PrefixIndex, slots: Slots, tb: bytes, first: int = 0, root: KeyRoot = ROOT, main: bool = False):
    n = len(tb) // (4 * B) - first
    s = slots.take(n)
    hashes = block_hashes(root, np.frombuffer(tb, dtype="<u4"))[first:]
    unused, node = ix.insert(root, tb, first, s, hashes, main=main)
    return s, unused, node


def check_accounting(ix: PrefixIndex) -> None:
    nodes = list(ix.iter_nodes())
    assert ix.num_blocks == sum(len(n.slots) for n in nodes)
    all_slots = [s for n in nodes for s in n.slots]
    assert len(all_slots) == len(set(all_slots))
    for n in nodes:
        assert n.pins >= sum(c.pins for c in n.children.values())
        assert len(n.tokens) == len(n.slots) * 4 * B == len(n.hashes) * 4 * B


def test_match_is_block_aligned_1507_tokens_match_1504():
    ix, sl = PrefixIndex(B), Slots()
    insert(ix, sl, toks((0, 2000)))
    m = ix.match(ROOT, toks((0, 1507)), 1507 // B)
    assert m.cached_blocks * B == 1504


def test_match_stops_at_first_differing_token_block():
    ix, sl = PrefixIndex(B), Slots()
    insert(ix, sl, toks((0, 320)))
    prompt = np.arange(320, dtype=np.uint32)
    prompt[5 * B + 7] = 77_777
    m = ix.match(ROOT, prompt.tobytes(), 20)
    assert m.cached_blocks == 5


def test_matching_compares_tokens_not_hashes():
    ix, sl = PrefixIndex(B), Slots()
    tb = toks((0, 64))
    # Insert with deliberately bogus hashes: the index must still match by tokens only.
    ix.insert(ROOT, tb, 0, sl.take(4), [b"\x00" * 16] * 4)
    assert ix.match(ROOT, tb, 4).cached_blocks == 4
    assert ix.match(ROOT, toks((1, 65)), 4).cached_blocks == 0


def test_other_roots_never_match():
    ix, sl = PrefixIndex(B), Slots()
    insert(ix, sl, toks((0, 64)))
    other = KeyRoot("t2", "m", "w1", "fp16", "rope", "attn")
    assert ix.match(other, toks((0, 64)), 4).cached_blocks == 0


def test_edge_split_keeps_pins_and_byte_accounting_exact():
    ix, sl = PrefixIndex(B), Slots()
    s, _, leaf = insert(ix, sl, toks((0, 160)))  # one 10-block edge
    held = ix.pin(ix.match(ROOT, toks((0, 160)), 10))
    assert held is leaf and leaf.pins == 1
    # A prompt diverging after block 4 splits the pinned edge.
    insert(ix, sl, toks((0, 64), (5000, 5032)), first=4)
    head = leaf.parent
    assert head.parent is not None and len(head.slots) == 4 and len(leaf.slots) == 6
    assert head.pins == 1 and leaf.pins == 1
    assert ix.slots_to(leaf) == s
    check_accounting(ix)
    assert ix.num_blocks == 12
    assert ix.unpin(held) == []
    assert head.pins == 0 and leaf.pins == 0


def test_a_walk_resumed_at_an_earlier_node_finds_what_a_walk_from_the_root_finds():
    ix, sl = PrefixIndex(B), Slots()
    prompt = toks((0, 64), (100, 164))                      # 8 blocks
    insert(ix, sl, toks((0, 64)))                           # blocks 0-3 cached
    reached = ix.pin(ix.match(ROOT, prompt, 8))
    assert reached.end_block == 4

    def same(limit):
        resumed, fresh = ix.match_after(reached, prompt, limit), ix.match(ROOT, prompt, limit)
        assert resumed is not None
        assert (resumed.node, resumed.within, resumed.cached_blocks) == \
            (fresh.node, fresh.within, fresh.cached_blocks)
        return fresh.cached_blocks

    assert same(8) == 4
    insert(ix, sl, prompt, first=4)                          # the rest of the prompt, cached meanwhile
    assert same(8) == 8 and same(6) == 6
    insert(ix, sl, toks((0, 32), (900, 932)), first=2)       # splits the edge `reached` ends
    assert reached.start_block == 2 and same(8) == 8
    assert ix.match_after(reached, prompt, 3) is None        # ends past the limit: walk from the root
    ix.unpin(reached)
    ix.evict(100)
    assert not reached.alive and ix.match_after(reached, prompt, 8) is None


def test_pinned_blocks_are_never_evicted():
    ix, sl = PrefixIndex(B), Slots()
    insert(ix, sl, toks((0, 64)))
    insert(ix, sl, toks((10_000, 10_064)))
    pinned = ix.pin(ix.match(ROOT, toks((0, 64)), 4))
    freed = ix.evict(100)
    assert len(freed) == 4 and ix.num_blocks == 4
    assert ix.match(ROOT, toks((0, 64)), 4).cached_blocks == 4
    ix.unpin(pinned)
    assert len(ix.evict(100)) == 4 and ix.num_blocks == 0


def test_eviction_takes_tails_before_heads_and_parents_after_their_children():
    clock = Clock()
    ix, sl = PrefixIndex(B, clock=clock), Slots()
    trunk, _, _ = insert(ix, sl, toks((0, 64)))                      # blocks 0-3
    a, _, _ = insert(ix, sl, toks((0, 64), (100, 132)), first=4)      # leaf A: 2 blocks
    clock.t += 1
    b, _, _ = insert(ix, sl, toks((0, 64), (200, 248)), first=4)      # leaf B: 3 blocks, newer
    # One block at a time: A's tail, A's head, then B from its tail, then the trunk
    # from its tail once it has become a leaf.
    order = [ix.evict(1)[0] for _ in range(9)]
    assert order == [a[1], a[0], b[2], b[1], b[0], trunk[3], trunk[2], trunk[1], trunk[0]]
    assert ix.num_blocks == 0 and ix.roots() == []


def test_in_main_the_least_recently_used_leaf_goes_first_whatever_its_hits():
    clock = Clock()
    ix, sl = PrefixIndex(B, clock=clock), Slots()
    often, _, _ = insert(ix, sl, toks((0, 32)), main=True)
    for _ in range(5):
        clock.t += 1
        ix.unpin(ix.pin(ix.match(ROOT, toks((0, 32)), 2)))
    clock.t += 1
    once, _, _ = insert(ix, sl, toks((500, 532)), main=True)
    assert ix.evict(2) == [often[1], often[0]]
    clock.t += 1
    again, _, _ = insert(ix, sl, toks((0, 32)), main=True)
    clock.t += 1
    ix.unpin(ix.pin(ix.match(ROOT, toks((0, 32)), 2)))  # a hit makes it the most recent
    assert ix.evict(2) == [once[1], once[0]]


def test_with_a_whole_cache_window_the_least_recent_leaf_goes_whichever_region_holds_it():
    clock = Clock()
    ix, sl = PrefixIndex(B, clock=clock), Slots()
    old, _, _ = insert(ix, sl, toks((0, 32)))                 # window, least recent
    clock.t += 1
    newer, _, _ = insert(ix, sl, toks((500, 532)), main=True)  # main, more recent
    clock.t += 1
    insert(ix, sl, toks((900, 932)))
    ix.window_target = ix.num_blocks                           # the window may hold everything
    duels = []
    assert ix.evict(2, duel=lambda c, v: duels.append(1) or True) == [old[1], old[0]]
    assert not duels                                           # plain LRU: no duel, no move to main
    assert ix.evict(2) == [newer[1], newer[0]]


def test_the_window_evicts_its_least_recent_leaf_whatever_its_hits():
    clock = Clock()
    ix, sl = PrefixIndex(B, clock=clock), Slots()
    hot, _, _ = insert(ix, sl, toks((0, 32)))
    for _ in range(5):
        ix.unpin(ix.pin(ix.match(ROOT, toks((0, 32)), 2)))
    clock.t += 1
    recent, _, _ = insert(ix, sl, toks((500, 532)))
    assert ix.evict(2) == [hot[1], hot[0]]


def test_a_window_candidate_that_loses_its_duel_is_evicted_and_main_keeps_its_victim():
    ix, sl = PrefixIndex(B), Slots()
    kept, _, _ = insert(ix, sl, toks((0, 32)), main=True)
    cand, _, _ = insert(ix, sl, toks((500, 532)))
    ix.window_target = 0
    duels = []
    freed = ix.evict(2, duel=lambda c, v: duels.append((c.slots[:], v.slots[:])) or False)
    assert freed == [cand[1], cand[0]] and duels[0] == (cand, kept)
    assert ix.match(ROOT, toks((0, 32)), 2).cached_blocks == 2


def test_a_window_candidate_that_wins_moves_to_main_and_the_victim_pays():
    ix, sl = PrefixIndex(B), Slots()
    victim, _, _ = insert(ix, sl, toks((0, 32)), main=True)
    cand, _, _ = insert(ix, sl, toks((500, 532)))
    ix.window_target = 0
    assert ix.evict(2, duel=lambda c, v: True) == [victim[1], victim[0]]
    assert ix.region_blocks == [0, 2]  # the candidate now lives in main
    assert ix.match(ROOT, toks((500, 532)), 2).cached_blocks == 2


def test_a_window_that_is_the_whole_cache_evicts_in_lru_order_without_duels():
    clock = Clock()
    ix, sl = PrefixIndex(B, clock=clock), Slots()
    a, _, _ = insert(ix, sl, toks((0, 32)))
    clock.t += 1
    b, _, _ = insert(ix, sl, toks((500, 532)))
    clock.t += 1
    ix.unpin(ix.pin(ix.match(ROOT, toks((0, 32)), 2)))  # a is now the most recent
    ix.window_target = 4
    duels = []
    assert ix.evict(2, duel=lambda c, v: duels.append(1) or True) == [b[1], b[0]]
    assert duels == [] and ix.match(ROOT, toks((0, 32)), 2).cached_blocks == 2


def test_hot_leaves_beyond_the_hot_budget_cool_back_into_the_window():
    ix, sl = PrefixIndex(B), Slots()
    hot, _, hot_node = insert(ix, sl, toks((0, 32)))
    ix.mark_hot(hot_node)
    cold, _, _ = insert(ix, sl, toks((500, 532)))
    ix.window_target = 4
    ix.hot_budget = 0  # the main region (and the pinned tier in it) has no share left
    assert ix.evict(2) == [hot[1], hot[0]]  # cooled to the window's least recent end
    assert ix.hot_blocks == 0 and ix.match(ROOT, toks((500, 532)), 2).cached_blocks == 2


def test_new_blocks_that_overflow_the_window_duel_for_their_slots():
    ix, sl = PrefixIndex(B), Slots()
    insert(ix, sl, toks((0, 32)), main=True)
    ix.window_target = 0
    assert ix.evict(2, incoming=lambda victim: False) == []      # they lose: no slot
    assert len(ix.evict(2, incoming=lambda victim: True)) == 2    # they win: main's victim pays


def test_hot_nodes_are_evicted_after_every_ordinary_node():
    clock = Clock()
    ix, sl = PrefixIndex(B, clock=clock), Slots()
    hot, _, hot_node = insert(ix, sl, toks((0, 32)))
    ix.mark_hot(hot_node)
    clock.t += 1
    cold, _, _ = insert(ix, sl, toks((500, 532)))
    for _ in range(5):
        ix.unpin(ix.pin(ix.match(ROOT, toks((500, 532)), 2)))
    assert ix.evict(4) == [cold[1], cold[0], hot[1], hot[0]]


def test_insert_of_already_cached_blocks_returns_the_new_slots_unused():
    ix, sl = PrefixIndex(B), Slots()
    first, _, _ = insert(ix, sl, toks((0, 64)))
    again, unused, _ = insert(ix, sl, toks((0, 96)))
    assert unused == again[:4]
    assert ix.slots_to(ix.pin(ix.match(ROOT, toks((0, 96)), 6))) == first + again[4:]
    check_accounting(ix)


def test_insert_after_an_evicted_prefix_attaches_nothing():
    ix, sl = PrefixIndex(B), Slots()
    insert(ix, sl, toks((0, 64)))
    s = sl.take(2)
    unused, node = ix.insert(ROOT, toks((7, 103)), 4, s, [b"\x01" * 16] * 2)
    assert unused == s and node is None and ix.num_blocks == 4


def test_drop_roots_frees_unpinned_now_and_pinned_on_release():
    ix, sl = PrefixIndex(B), Slots()
    s1, _, _ = insert(ix, sl, toks((0, 64)))
    s2, _, _ = insert(ix, sl, toks((900, 964)))
    held = ix.pin(ix.match(ROOT, toks((0, 64)), 4))
    dropped, freed = ix.drop_roots(lambda r: r.tenant == "t1")
    assert dropped == 8 and sorted(freed) == sorted(s2)
    assert ix.dead_blocks == 4 and ix.num_blocks == 0
    assert ix.match(ROOT, toks((0, 64)), 4).cached_blocks == 0
    assert sorted(ix.unpin(held)) == sorted(s1)
    assert ix.dead_blocks == 0


def test_unpin_without_pin_is_a_caller_bug():
    ix, sl = PrefixIndex(B), Slots()
    _, _, node = insert(ix, sl, toks((0, 32)))
    with pytest.raises(RuntimeError):
        ix.unpin(node)


def test_bad_block_size_is_rejected():
    with pytest.raises(ValueError, match="block_size"):
        PrefixIndex(0)
