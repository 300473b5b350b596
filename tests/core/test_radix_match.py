"""The radix index's match and what it hands back: the matched hashes, slots, nodes and
tokens along a path of several edges, a walk cut short by the limit or the prompt's
length, cutting a match back, resuming a walk, and what pinning a match does to the
path. Fast: the mutation run's tests for the match (docs/MUTATION.md)."""
from __future__ import annotations

import numpy as np
import pytest

from kvtier.eviction import MAIN, WINDOW
from kvtier.keys import KeyRoot, block_hashes
from kvtier.radix import Match, PrefixIndex, _equal_prefix_blocks

B = 4
ROOT = KeyRoot("t1", "m", "w1", "fp16", "rope", "attn")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def toks(*runs: tuple[int, int]) -> bytes:
    return np.concatenate([np.arange(a, b, dtype=np.uint32) for a, b in runs]).astype("<u4").tobytes()


def hashes(tb: bytes) -> list[bytes]:
    return block_hashes(ROOT, np.frombuffer(tb, dtype="<u4"), block_size=B)


class Index:
    """An index with a clock, and slot ids handed out in order."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.ix = PrefixIndex(B, clock=self.clock)
        self.next = 0

    def insert(self, tb: bytes, first: int = 0, **kw):
        n = len(tb) // (4 * B) - first
        slots = list(range(self.next, self.next + n))
        self.next += n
        unused, node = self.ix.insert(ROOT, tb, first, slots, hashes(tb)[first:first + n], **kw)
        return slots, node


@pytest.fixture()
def three_edges():
    """Blocks 0-1 | 2-4 | 5-6 of one prompt, as three edges (two later prompts split it)."""
    idx = Index()
    prompt = toks((0, 28))                                   # 7 blocks
    slots, leaf = idx.insert(prompt)
    idx.insert(toks((0, 8), (500, 508)), first=2)            # diverges after block 2: split at 2
    idx.insert(toks((0, 20), (900, 904)), first=5)           # diverges after block 5: split at 5
    return idx, prompt, slots, leaf


def test_a_path_of_edges_hands_back_the_prompts_hashes_slots_nodes_and_tokens(three_edges):
    idx, prompt, slots, leaf = three_edges
    ix = idx.ix
    path = ix.path(leaf)
    assert [(n.start_block, n.num_blocks) for n in path] == [(0, 2), (2, 3), (5, 2)]
    assert [n.end_block for n in path] == [2, 5, 7]
    m = ix.match(ROOT, prompt, 7)
    assert (m.node, m.within, m.cached_blocks) == (leaf, 2, 7)
    assert ix.hashes_to(m) == hashes(prompt)
    assert m.last_hash() == hashes(prompt)[6]
    assert ix.slots_to(leaf) == slots
    assert ix.prefix_tokens(leaf) == prompt
    inner = ix.match(ROOT, prompt, 4)                        # ends inside the middle edge
    assert (inner.node, inner.within, inner.cached_blocks) == (path[1], 2, 4)
    assert ix.hashes_to(inner) == hashes(prompt)[:4] and inner.last_hash() == hashes(prompt)[3]
    one_in = ix.match(ROOT, prompt, 3)                       # one block into the middle edge
    assert (one_in.node, one_in.within) == (path[1], 1) and ix.hashes_to(one_in) == hashes(prompt)[:3]


def test_a_miss_hands_back_nothing():
    idx = Index()
    idx.insert(toks((0, 16)))
    miss = idx.ix.match(ROOT, toks((100, 116)), 4)           # the root exists, no edge matches
    assert miss.node is not None and miss.node.parent is None and (miss.within, miss.cached_blocks) == (0, 0)
    assert miss.last_hash() is None and idx.ix.hashes_to(miss) == []
    unknown = idx.ix.match(KeyRoot("t9", "m", "w1", "fp16", "rope", "attn"), toks((0, 16)), 4)
    assert unknown == Match(None, 0, 0) and unknown.last_hash() is None and idx.ix.hashes_to(unknown) == []


def test_the_walk_stops_at_the_limit_and_at_the_prompts_last_whole_block(three_edges):
    idx, prompt, _, leaf = three_edges
    ix = idx.ix
    for limit in range(8):
        assert ix.match(ROOT, prompt, limit).cached_blocks == min(limit, 7)
    assert ix.match(ROOT, prompt, 100).cached_blocks == 7
    assert ix.match(ROOT, prompt[:4 * B * 3 + 8], 7).cached_blocks == 3   # a partial 4th block
    assert ix.match(ROOT, prompt + toks((5000, 5008)), 100).cached_blocks == 7  # longer than cached


def test_a_difference_past_the_limit_does_not_count_and_one_within_it_does():
    idx = Index()
    idx.insert(toks((0, 32)))                                # one edge of 8 blocks
    diverged = np.arange(32, dtype=np.uint32)
    diverged[6 * B + 1] = 77_777                             # block 6 differs
    tb = diverged.astype("<u4").tobytes()
    assert idx.ix.match(ROOT, tb, 5).cached_blocks == 5      # the difference lies past the limit
    assert idx.ix.match(ROOT, tb, 6).cached_blocks == 6
    assert idx.ix.match(ROOT, tb, 7).cached_blocks == 6
    assert idx.ix.match(ROOT, tb, 8).cached_blocks == 6
    diverged[1] = 5                                          # block 0 differs too: first bytes do not match
    assert idx.ix.match(ROOT, diverged.astype("<u4").tobytes(), 8).cached_blocks == 0


def test_a_walk_that_diverges_inside_an_edge_ends_there_whatever_lies_below_the_edge():
    """A prompt whose block at the divergence equals the first block of the edge's child
    must not resume the walk in that child (it would hand out KV for blocks the prompt
    does not have at that position)."""
    idx = Index()
    a, b, c, d = (0, 4), (4, 8), (8, 12), (12, 16)
    idx.insert(toks(a, b, c))
    idx.insert(toks(a, b, c, d), first=3)                    # edge A B C, its child D
    prompt = toks(a, b, d, (100, 104))
    m = idx.ix.match(ROOT, prompt, 4)
    assert m.cached_blocks == 2 and m.within == 2 and m.node.num_blocks == 3
    assert idx.ix.hashes_to(m) == hashes(prompt)[:2]


def test_equal_prefix_blocks_counts_up_to_the_first_different_block():
    edge = toks((0, 16))
    same = np.arange(16, dtype=np.uint32)
    assert _equal_prefix_blocks(edge, same.tobytes(), 0, 4, B) == 4
    assert _equal_prefix_blocks(edge, same.tobytes(), 0, 2, B) == 2
    same[2 * B + 3] = 1
    assert _equal_prefix_blocks(edge, same.tobytes(), 0, 4, B) == 2
    shifted = np.concatenate([np.full(B, 9, dtype=np.uint32), np.arange(16, dtype=np.uint32)])
    assert _equal_prefix_blocks(edge, shifted.tobytes(), 4 * B, 4, B) == 4  # the prompt's offset


def test_cutting_a_match_back(three_edges):
    idx, prompt, _, leaf = three_edges
    ix = idx.ix
    middle = leaf.parent
    m = ix.match(ROOT, prompt, 7)
    assert ix.truncate(m, 7) == m and ix.truncate(m, 9) == m
    assert ix.truncate(m, 6) == Match(leaf, 1, 6)
    assert ix.truncate(m, 5) == Match(middle, 3, 5)          # an edge boundary: the edge before, whole
    assert ix.truncate(m, 3) == Match(middle, 1, 3)
    assert ix.truncate(m, 2) == Match(middle.parent, 2, 2)
    cut = ix.truncate(m, 0)
    assert cut.node is not None and cut.node.parent is None and (cut.within, cut.cached_blocks) == (0, 0)
    assert ix.hashes_to(ix.truncate(m, 4)) == hashes(prompt)[:4]


def test_a_resumed_walk_needs_a_live_node_under_a_root_ending_within_the_limit(three_edges):
    idx, prompt, _, leaf = three_edges
    ix = idx.ix
    middle = leaf.parent
    assert ix.match_after(middle, prompt, 5) == Match(middle, 3, 5)   # ends exactly at the limit
    assert ix.match_after(middle, prompt, 4) is None
    assert ix.match_after(middle, prompt, 7) == Match(leaf, 2, 7)
    sentinel = middle.parent.parent
    assert sentinel.parent is None and ix.match_after(sentinel, prompt, 7) is None


def test_pinning_a_match_pins_and_touches_its_path_and_unpinning_undoes_it(three_edges):
    idx, prompt, _, leaf = three_edges
    ix = idx.ix
    path = ix.path(leaf)
    sentinel = path[0].parent
    idx.clock.t = 2000.0
    versions = [n.version for n in path]
    held = ix.pin(ix.match(ROOT, prompt, 7))
    assert held is leaf and [n.pins for n in path] == [1, 1, 1] and sentinel.pins == 1
    assert [n.last_access_s for n in path] == [2000.0] * 3 and sentinel.last_access_s == 0.0
    assert [n.version for n in path] == [v + 1 for v in versions]
    assert all(n.freq.t_s == 2000.0 for n in path)
    assert list(ix._window)[-3:] == path[::-1]               # the path is the window's most recent, leaf first
    idx.clock.t = 3000.0
    quiet = ix.pin(ix.match(ROOT, prompt, 7), touch=False)   # counted, not a use
    assert quiet is leaf and [n.pins for n in path] == [2, 2, 2] and sentinel.pins == 2
    assert [n.last_access_s for n in path] == [2000.0] * 3
    assert ix.unpin(quiet) == [] and ix.unpin(held) == []
    assert [n.pins for n in path] == [0, 0, 0] and sentinel.pins == 0
    with pytest.raises(RuntimeError, match="unpin without"):
        ix.unpin(held)
    with pytest.raises(RuntimeError, match="empty match"):
        ix.pin(Match(None, 0, 0))


def test_pinning_a_match_that_ends_inside_an_edge_splits_it_there(three_edges):
    idx, prompt, slots, leaf = three_edges
    ix = idx.ix
    middle, first = leaf.parent, leaf.parent.parent          # blocks 2-4, 0-1
    nodes = ix.num_nodes
    held = ix.pin(ix.match(ROOT, prompt, 3))
    assert (held.start_block, held.num_blocks, held.parent) == (2, 1, first)
    assert first.children[prompt[2 * 4 * B:3 * 4 * B]] is held
    assert (middle.start_block, middle.num_blocks, middle.parent) == (3, 2, held)
    assert held.pins == 1 and middle.pins == 0 and ix.num_nodes == nodes + 1
    assert ix.slots_to(held) == slots[:3] and ix.slots_to(leaf) == slots
    assert ix.prefix_tokens(leaf) == prompt and ix.match(ROOT, prompt, 7).cached_blocks == 7
    assert held.children == {prompt[3 * 4 * B:4 * 4 * B]: middle}
    whole = ix.pin(ix.match(ROOT, prompt, 5))                # ends at an edge's end: no split
    assert whole is middle and ix.num_nodes == nodes + 1
    ix.unpin(whole)
    ix.unpin(held)


def test_a_split_head_keeps_the_tails_pins_use_hotness_and_region():
    idx = Index()
    prompt = toks((0, 24))
    slots, node = idx.insert(prompt, main=True)
    idx.ix.mark_hot(node)
    idx.clock.t = 1500.0
    held = idx.ix.pin(idx.ix.match(ROOT, prompt, 6))
    freq = (node.freq.freq, node.freq.t_s)
    head = idx.ix._split(node, 2)
    assert (head.pins, head.hot, head.region, head.last_access_s) == (1, True, MAIN, 1500.0)
    assert (head.freq.freq, head.freq.t_s) == freq and head.freq is not node.freq
    assert head.slots == slots[:2] and node.slots == slots[2:] and head.hashes == hashes(prompt)[:2]
    assert idx.ix.hot_blocks == 6 and idx.ix.region_blocks == [0, 6] and idx.ix.num_blocks == 6
    assert idx.ix.unpin(held) == [] and head.pins == 0 and node.pins == 0


def test_a_split_window_edge_keeps_both_parts_in_the_window():
    idx = Index()
    prompt = toks((0, 24))
    _, node = idx.insert(prompt)
    head = idx.ix._split(node, 4)
    assert head.region == WINDOW and head in idx.ix._window and node in idx.ix._window
    assert idx.ix.region_blocks == [6, 0]


def test_unpinning_the_last_reader_of_a_dropped_tree_frees_its_slots():
    idx = Index()
    prompt = toks((0, 16))
    slots, _ = idx.insert(prompt)
    held = idx.ix.pin(idx.ix.match(ROOT, prompt, 4))
    again = idx.ix.pin(idx.ix.match(ROOT, prompt, 4))
    assert idx.ix.drop_roots(lambda r: True) == (4, [])
    assert idx.ix.unpin(again) == [] and idx.ix.dead_blocks == 4   # a reader is left
    assert idx.ix.unpin(held) == slots and idx.ix.dead_blocks == 0


def test_an_unpinned_leaf_can_be_evicted_again_and_an_emptied_root_goes():
    idx = Index()
    prompt = toks((0, 16))
    slots, _ = idx.insert(prompt, main=True)
    held = idx.ix.pin(idx.ix.match(ROOT, prompt, 4))
    assert idx.ix.evict(4) == []                             # pinned
    idx.ix.unpin(held)
    assert idx.ix.evict(4) == slots[::-1] and idx.ix.roots() == []


def test_a_pinned_miss_keeps_its_root_until_unpinned_and_an_empty_root_then_goes():
    """A reservation on a miss pins the root alone; its tree may empty meanwhile, and the
    root must go when the reservation does, or a dropped-out root would linger."""
    idx = Index()
    prompt = toks((0, 16))
    idx.insert(prompt)
    reserved = idx.ix.pin(idx.ix.match(ROOT, toks((100, 116)), 4))   # a miss: the root itself
    assert reserved.parent is None and reserved.pins == 1
    assert len(idx.ix.evict(100)) == 4 and idx.ix.roots() == [ROOT]   # still held
    assert idx.ix.unpin(reserved) == []
    assert idx.ix.roots() == [] and not reserved.alive
    assert idx.ix.match(ROOT, prompt, 4) == Match(None, 0, 0)
