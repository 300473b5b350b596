"""The local prefix index: a radix tree over token ids, one tree per key root.

Each edge holds a whole number of blocks (tokens in the canonical little-endian
uint32 encoding) plus, per block, the slot holding its KV and its chained hash.
Matching compares TOKENS, never hashes (rule: tokens-not-hashes): a child is found by the exact bytes
of its first block and the rest of the edge is compared token for token, so two
prompts whose hashes collide still get only their own KV.

Invariants, kept where state changes:

* Pins: `pins` of a node = number of live holders (hits, reservations) whose path runs
  through it. Pinning walks from a node to its root and increments every node; an
  unpin walks the same way. Splitting an edge gives the new head the tail's pin count,
  so an unpin that walks up from the tail still decrements exactly what was pinned.
* Eviction takes only unpinned leaves, and only from the tail of the edge: tails go
  before heads, a parent becomes a leaf (evictable) when its last child goes, so a
  block is never kept while its parent is evicted. Which leaf goes is W-TinyLFU's
  choice (`kvtier.eviction`): every node is in the window (an LRU list; touching a
  node moves it and its ancestors to the recent end) or in the main region (a heap
  of evictable leaves, least recently used first, hot nodes last).
* Byte accounting: `num_blocks` = blocks reachable from live roots; `dead_blocks` =
  blocks of invalidated nodes still pinned by a reader. Every block ever inserted is
  in exactly one of: the index, a dead pinned node, or returned to the caller.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator

import heapq
import itertools

import numpy as np

from kvtier.eviction import MAIN, WINDOW, DecayedFrequencyPolicy, FrequencyState
from kvtier.keys import BlockHash, KeyRoot, check_block_size

Duel = Callable[["Node", "Node"], bool]
"""(window candidate, main victim) -> does the candidate move into main?"""


class Node:
    """One edge of the tree: a run of blocks after `parent`'s last block.

    The root sentinel of a tree has no blocks and no parent. `start_block` is the
    index, in the prompt, of this edge's first block. Compared by identity. (A plain
    class rather than a dataclass: compiled, it is an extension type whose fields the
    index's loops read directly, radix.pxd.)
    """

    __slots__ = ("root", "parent", "tokens", "slots", "hashes", "start_block", "children", "pins", "freq",
                 "last_access_s", "hot", "region", "alive", "version", "queued")

    def __init__(self, root: KeyRoot, parent: Node | None, tokens: bytes, slots: list[int],
                 hashes: list[BlockHash], start_block: int, children: dict[bytes, Node] | None = None,
                 pins: int = 0, freq: FrequencyState | None = None, last_access_s: float = 0.0,
                 hot: bool = False, region: int = WINDOW, alive: bool = True, version: int = 0,
                 queued: int = -1) -> None:
        self.root = root
        self.parent = parent
        self.tokens = tokens
        self.slots = slots
        self.hashes = hashes
        self.start_block = start_block
        self.children = {} if children is None else children
        self.pins = pins
        self.freq = FrequencyState() if freq is None else freq
        self.last_access_s = last_access_s
        self.hot = hot
        self.region = region
        self.alive = alive
        self.version = version
        self.queued = queued  # the version last queued as an eviction victim

    def __repr__(self) -> str:
        return (f"Node(start_block={self.start_block}, blocks={len(self.slots)}, pins={self.pins}, "
                f"region={self.region}, hot={self.hot}, alive={self.alive})")

    @property
    def num_blocks(self) -> int:
        return len(self.slots)

    @property
    def end_block(self) -> int:
        return self.start_block + len(self.slots)


@dataclass(slots=True, init=False)
class Match:
    """Where a prompt's walk ended: `node` with its first `within` blocks matched.

    `cached_blocks` = blocks of the prompt present in the index from block 0 on.
    """

    node: Node | None
    within: int
    cached_blocks: int

    def __init__(self, node: Node | None, within: int, cached_blocks: int) -> None:
        # Written out (not the dataclass's): compiled with the module, the two or three
        # made per request run no interpreted frame.
        self.node = node
        self.within = within
        self.cached_blocks = cached_blocks

    def last_hash(self) -> bytes | None:
        """Hash of the last matched block, or None when nothing matched."""
        if self.node is None or self.within == 0:
            return None
        return self.node.hashes[self.within - 1]


class PrefixIndex:
    """Token radix trees per key root, with pins and leaf-first eviction.

    The index owns no memory: callers hand it slot ids on `insert` and get slot ids
    back from `evict`, `unpin` (of an invalidated node) and `drop_roots`.
    """

    def __init__(self, block_size: int, policy: DecayedFrequencyPolicy | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        import time

        self.block_size = check_block_size(block_size)
        self.block_token_bytes = 4 * self.block_size
        self.policy = policy or DecayedFrequencyPolicy()
        self.clock = clock or time.monotonic
        self._roots: dict[KeyRoot, Node] = {}
        self._window: OrderedDict[Node, None] = OrderedDict()  # least recent first
        self._heap: list[tuple[int, float, int, int, Node]] = []  # main's evictable leaves
        self._seq = itertools.count()
        self.region_blocks = [0, 0]
        # Blocks the window may hold before its least recent leaf must leave it
        # (the owner sets it; W-TinyLFU's adaptive share).
        self.window_target = float("inf")
        # Blocks the hot (pinned) tier may hold; beyond it, the least recent hot
        # leaves cool back to ordinary (the owner sets it).
        self.hot_budget = float("inf")
        # Told (region, hashes) of every block eviction takes (the owner's removal log and window tuner).
        self.on_evict: Callable[[int, list[BlockHash]], None] | None = None
        self.num_blocks = 0
        self.dead_blocks = 0
        self.hot_blocks = 0
        self.num_nodes = 0
        # Per tenant holding blocks (an entry goes when its tenant's last block does, so
        # both stay bounded by the slots, however many tenants come and go).
        self.tenant_blocks: dict[str, int] = {}
        self.tenant_evictions: dict[str, int] = {}

    # ------------------------------------------------------------------ matching

    def match(self, root: KeyRoot, token_bytes: bytes, limit_blocks: int) -> Match:
        """Longest cached prefix of the prompt, in whole blocks, up to `limit_blocks`.

        Pure: never changes the tree. `token_bytes` is the canonical prompt encoding.
        """
        node = self._roots.get(root)
        if node is None:
            return Match(None, 0, 0)
        return self._walk(node, 0, 0, token_bytes, limit_blocks)

    def match_after(self, node: Node, token_bytes: bytes, limit_blocks: int) -> Match | None:
        """`match` resumed at the end of `node`, a node an earlier walk of this same
        prompt (same root) reached: what `match` would return, without comparing
        the path to `node` again. None when `node` has left the index or ends past
        the limit (the caller then matches from the root).

        Sound because a live node's path keeps spelling the prompt: splits keep
        the path's tokens, and only a leaf's own tail is ever trimmed."""
        end = node.start_block + len(node.slots)
        if not node.alive or node.parent is None or end > limit_blocks:
            return None
        return self._walk(node, len(node.slots), end, token_bytes, limit_blocks)

    def _walk(self, node: Node, within: int, pos: int, token_bytes: bytes, limit_blocks: int) -> Match:
        """Descend from `node` (its first `within` blocks matched, `pos` prompt
        blocks matched in all), comparing tokens, up to `limit_blocks`."""
        step = self.block_token_bytes
        limit_blocks = min(limit_blocks, len(token_bytes) // step)
        while pos < limit_blocks:
            off = pos * step
            child = node.children.get(token_bytes[off:off + step])
            if child is None:
                break
            size = len(child.slots)
            if size <= limit_blocks - pos:  # the whole edge is within the limit
                n, same = size, token_bytes.startswith(child.tokens, off)
            else:
                n = limit_blocks - pos
                same = child.tokens.startswith(token_bytes[off:off + n * step])
            if same:
                k = n
            else:
                k = _equal_prefix_blocks(child.tokens, token_bytes, off, n, self.block_size)
            node, within, pos = child, k, pos + k
            if k < size:
                break
        return Match(node, within, pos)

    def truncate(self, m: Match, blocks: int) -> Match:
        """The same walk cut back to its first `blocks` blocks (<= m.cached_blocks)."""
        node, cached = m.node, m.cached_blocks
        if blocks >= cached:
            return m
        while node is not None and node.start_block >= blocks and node.parent is not None:
            node = node.parent
        if node is None or node.parent is None:
            return Match(node, 0, 0)
        return Match(node, blocks - node.start_block, blocks)

    # ------------------------------------------------------------------ pins

    def pin(self, m: Match, touch: bool = True) -> Node:
        """Pin the matched path (splitting the last edge at the match) and return the
        deepest pinned node; `slots_to(node)` lists the matched slots."""
        node = m.node
        if node is None:
            raise RuntimeError("cannot pin an empty match")
        if 0 < m.within < len(node.slots):
            node = self._split(node, m.within)
        n: Node | None = node
        if not touch:
            while n is not None:
                n.pins += 1
                n = n.parent
            return node
        now, touch_freq, to_end = self.clock(), self.policy.touch, self._window.move_to_end
        while n is not None:
            n.pins += 1
            if n.parent is not None:
                touch_freq(n.freq, now)
                n.last_access_s = now
                n.version += 1
                if n.region == WINDOW:
                    to_end(n)
            n = n.parent
        return node

    def unpin(self, node: Node) -> list[int]:
        """Undo one `pin` that returned `node`. Returns slots that are now free
        (blocks of invalidated nodes whose last reader just left)."""
        freed: list[int] = []
        n: Node | None = node
        while n is not None:
            if n.pins <= 0:
                raise RuntimeError("unpin without a matching pin")
            n.pins -= 1
            if n.pins == 0:
                if not n.alive:
                    freed.extend(n.slots)
                    self.dead_blocks -= len(n.slots)
                    n.slots = []
                elif not n.children and n.parent is not None:
                    self._push(n)
                elif n.parent is None and not n.children:
                    self._drop_empty_root(n)
            n = n.parent
        return freed

    @staticmethod
    def slots_to(node: Node) -> list[int]:
        """Slots of every block from the root to the end of `node`, in prompt order."""
        parts: list[list[int]] = []
        n: Node | None = node
        while n is not None and n.parent is not None:
            parts.append(n.slots)
            n = n.parent
        out: list[int] = []
        for p in reversed(parts):
            out.extend(p)
        return out

    @staticmethod
    def hashes_to(m: Match) -> list[BlockHash]:
        """Hashes of the matched blocks, in prompt order."""
        if m.node is None or m.within == 0:
            return []
        parts = [m.node.hashes[:m.within]]
        n = m.node.parent
        while n is not None and n.parent is not None:
            parts.append(n.hashes)
            n = n.parent
        out: list[BlockHash] = []
        for p in reversed(parts):
            out.extend(p)
        return out

    @staticmethod
    def path(node: Node) -> list[Node]:
        """Nodes from the first edge under the root down to `node`."""
        out: list[Node] = []
        n: Node | None = node
        while n is not None and n.parent is not None:
            out.append(n)
            n = n.parent
        out.reverse()
        return out

    # ------------------------------------------------------------------ insertion

    def insert(self, root: KeyRoot, token_bytes: bytes, first_block: int, slots: list[int],
               hashes: list[BlockHash], hot: bool = False, main: bool = False,
               after: Node | None = None) -> tuple[list[int], Node | None]:
        """Attach blocks [first_block, first_block + len(slots)) of the prompt, in the
        window (or, when hot or `main`, straight in the main region). `after`, when
        given, is a node an earlier walk of this prompt reached (a reservation's
        pinned parent): the walk resumes there (`match_after`).

        Blocks already present (inserted meanwhile by someone else) keep their old
        slots; the corresponding new slots are returned as unused. If the prefix before
        `first_block` is no longer cached, nothing is inserted and every slot comes
        back. Returns (unused_slots, deepest node holding the prompt's blocks or None).
        """
        if len(hashes) != len(slots):
            raise RuntimeError("insert needs one hash per slot")
        end = first_block + len(slots)
        if root not in self._roots:
            if first_block != 0:
                return list(slots), None
            self._roots[root] = Node(root, None, b"", [], [], 0)
        m = self.match_after(after, token_bytes, end) if after is not None else None
        if m is None:
            m = self.match(root, token_bytes, end)
        pos = m.cached_blocks
        if pos < first_block:
            return list(slots), None
        used_from = pos - first_block
        unused = list(slots[:used_from])
        node = m.node
        assert node is not None
        if 0 < m.within < len(node.slots):
            node = self._split(node, m.within)
        if pos == end:
            return unused, node
        step = self.block_token_bytes
        now = self.clock()
        new = Node(root, node, token_bytes[pos * step:end * step], list(slots[used_from:]),
                   list(hashes[used_from:]), pos, hot=hot, region=MAIN if hot or main else WINDOW,
                   last_access_s=now)
        self.policy.touch(new.freq, now)
        node.children[new.tokens[:step]] = new
        self._count(new, +1)
        if new.region == WINDOW:
            self._window[new] = None
            # Window ancestors become more recent than their new child, so the
            # window's least recent node is a leaf unless its children left.
            n = node
            while n.parent is not None:
                if n.region == WINDOW:
                    self._window.move_to_end(n)
                n = n.parent
        else:
            self._push(new)
        return unused, new

    # ------------------------------------------------------------------ eviction

    def evict(self, num_blocks: int, duel: Duel | None = None,
              incoming: Callable[[Node], bool] | None = None) -> list[int]:
        """Free up to `num_blocks` blocks from unpinned leaves, each leaf from its tail.
        Returns the freed slots (fewer if everything else is pinned).

        While the window holds more than `window_target` blocks, its least recent
        leaf (the candidate) meets main's least recent leaf (the victim):
        `duel(candidate, victim)` true moves the candidate into main and the victim
        pays; false evicts the candidate. Without a duel the candidate always moves.
        When the blocks being made room for are more than the whole window may
        hold and it has no leaf left to offer, they are the candidate themselves:
        `incoming(victim)` false stops here (fewer slots; free space was already
        used up).
        A whole-cache window (`window_target` >= every cached block) is plain LRU: the
        least recent leaf goes, whichever region holds it, with no duel.
        Otherwise main's victim goes, then the window's least recent leaf; hot
        (pinned-tier) leaves go only when nothing else is left.
        """
        freed: list[int] = []
        regions, window_candidate, peek_victim, trim = (self.region_blocks, self._window_candidate,
                                                        self._peek_victim, self._trim_tail)
        while len(freed) < num_blocks:
            need = num_blocks - len(freed)
            whole = self.window_target >= self.num_blocks  # a whole-cache window: plain LRU
            over = whole or regions[WINDOW] + num_blocks > self.window_target
            cand = window_candidate() if over else None
            victim = peek_victim()
            if over and cand is None and num_blocks > self.window_target and victim is not None \
                    and incoming is not None and not victim.hot:
                if not incoming(victim):
                    break
                trim(victim, need, freed)
                continue
            if victim is not None and victim.hot:
                if self._cooled(victim):
                    continue
                other = cand or window_candidate()
                if other is not None:  # hot leaves outlast every ordinary block
                    trim(other, need, freed)
                    continue
            if cand is not None:
                if whole:  # the least recent leaf goes, whichever region holds it
                    lru = victim is None or victim.hot or cand.last_access_s <= victim.last_access_s
                    trim(cand if lru else victim, need, freed)
                    continue
                if victim is None:
                    self._to_main(cand)  # main is empty: nothing to duel with
                elif duel is None or duel(cand, victim):
                    self._to_main(cand)
                    trim(victim, need, freed)
                else:
                    trim(cand, need, freed)
                continue
            node = victim or window_candidate()
            if node is None:
                break
            trim(node, need, freed)
        return freed

    def _window_candidate(self) -> Node | None:
        """The window's least recent evictable leaf. Window nodes met on the way that
        still have children move to main: their children need them."""
        inner: list[Node] | None = None
        found = None
        for n in self._window:
            if n.pins or not n.slots:
                continue
            if n.children:
                if inner is None:
                    inner = []
                inner.append(n)
                continue
            found = n
            break
        if inner is not None:
            for n in inner:
                self._to_main(n)
        return found

    def _to_main(self, n: Node) -> None:
        del self._window[n]
        self.region_blocks[WINDOW] -= len(n.slots)
        n.region = MAIN
        self.region_blocks[MAIN] += len(n.slots)
        if self._evictable(n):
            self._push(n)

    def _peek_victim(self) -> Node | None:
        """Main's least recent evictable leaf, left in the heap (a duel it wins
        keeps it there)."""
        heap = self._heap
        while heap:
            entry = heap[0]
            node, version = entry[4], entry[3]
            if node.region != MAIN or not self._evictable(node):
                heapq.heappop(heap)
                if node.queued == version:
                    node.queued = -1  # not queued any more: a later push must go in
                continue
            if version != node.version:
                heapq.heappop(heap)
                if node.queued == version:
                    node.queued = -1
                if node.queued != node.version:
                    self._push(node)  # stale key: requeue with its current one
                continue
            return node
        return None

    def _trim_tail(self, node: Node, max_blocks: int, freed: list[int]) -> None:
        """Evict up to `max_blocks` blocks from the leaf's tail, appending their
        slots to `freed`, tail first."""
        slots, hashes, tokens, step = node.slots, node.hashes, node.tokens, self.block_token_bytes
        size = len(slots)
        k = max_blocks if max_blocks < size else size
        keep = size - k
        freed.extend(reversed(slots[keep:]))
        if self.on_evict is not None:
            self.on_evict(node.region, hashes[keep:])
        node.slots, node.hashes, node.tokens = slots[:keep], hashes[:keep], tokens[:keep * step]
        evictions, t = self.tenant_evictions, node.root.tenant
        evictions[t] = evictions.get(t, 0) + k
        self._count_blocks(node, -k)
        if keep:
            node.version += 1  # its queued entry (if any) is stale now
            self._push(node)
            return
        parent = node.parent
        assert parent is not None
        del parent.children[tokens[:step]]
        if node.region == WINDOW:
            del self._window[node]
        node.alive = False
        self.num_nodes -= 1
        if not parent.children and parent.pins == 0:
            if parent.parent is None:
                self._drop_empty_root(parent)
            else:
                self._push(parent)

    # ------------------------------------------------------------------ invalidation

    def drop_roots(self, predicate: Callable[[KeyRoot], bool]) -> tuple[int, list[int]]:
        """Remove every tree whose root satisfies `predicate`.

        Nothing can hit a dropped tree again. Unpinned blocks' slots come back at
        once; pinned ones come back from `unpin` when their last reader leaves.
        Returns (blocks dropped from the index, slots free now).
        """
        doomed = [r for r in self._roots if predicate(r)]
        dropped, freed = 0, []
        for r in doomed:
            sentinel = self._roots.pop(r)
            stack = [sentinel]
            while stack:
                n = stack.pop()
                stack.extend(n.children.values())
                n.alive = False
                if n.parent is None:
                    continue
                if n.region == WINDOW:
                    del self._window[n]
                dropped += len(n.slots)
                self._count_blocks(n, -len(n.slots))
                self.num_nodes -= 1
                if n.pins == 0:
                    freed.extend(n.slots)
                    n.slots = []
                else:
                    self.dead_blocks += len(n.slots)
        return dropped, freed

    # ------------------------------------------------------------------ hot tier

    def mark_hot(self, node: Node) -> int:
        """Mark `node` and its ancestors hot (evicted after every ordinary node).
        Returns the number of blocks that became hot."""
        added = 0
        for n in self.path(node):
            if not n.hot:
                if n.region == WINDOW:
                    self._to_main(n)
                n.hot = True
                n.version += 1
                added += len(n.slots)
                self.hot_blocks += len(n.slots)
        return added

    def _cooled(self, n: Node) -> bool:
        """While the hot tier holds more than `hot_budget` blocks (its share shrank
        with the main region's), its least recent leaf goes back to the ordinary
        order: to the window, as its least recent entry, so its next step out is
        judged like any other window leaf's. Returns whether it cooled."""
        if self.hot_blocks <= self.hot_budget:
            return False
        n.hot = False
        n.version += 1
        self.hot_blocks -= len(n.slots)
        self.region_blocks[MAIN] -= len(n.slots)
        self.region_blocks[WINDOW] += len(n.slots)
        n.region = WINDOW
        self._window[n] = None
        self._window.move_to_end(n, last=False)
        return True

    # ------------------------------------------------------------------ inspection

    def roots(self) -> list[KeyRoot]:
        return list(self._roots)

    def iter_nodes(self, predicate: Callable[[KeyRoot], bool] | None = None) -> Iterator[Node]:
        """Every non-sentinel node of the trees whose root satisfies `predicate`."""
        for r, sentinel in list(self._roots.items()):
            if predicate is not None and not predicate(r):
                continue
            stack = list(sentinel.children.values())
            while stack:
                n = stack.pop()
                yield n
                stack.extend(n.children.values())

    @staticmethod
    def prefix_tokens(node: Node) -> bytes:
        """Canonical token bytes from block 0 to the end of `node`."""
        return b"".join(n.tokens for n in PrefixIndex.path(node))

    # ------------------------------------------------------------------ internals

    def _split(self, node: Node, k: int) -> Node:
        """Split `node` after its first k blocks; returns the new head.

        The head takes the tail's place under the parent and inherits its pins,
        frequency and hotness, so pin counts and byte totals are unchanged.
        """
        step = self.block_token_bytes
        parent = node.parent
        assert parent is not None and 0 < k < len(node.slots)
        head = Node(node.root, parent, node.tokens[:k * step], node.slots[:k], node.hashes[:k],
                    node.start_block, pins=node.pins, freq=FrequencyState(node.freq.freq, node.freq.t_s),
                    last_access_s=node.last_access_s, hot=node.hot, region=node.region)
        if head.region == WINDOW:  # blocks move from node to head: region totals unchanged
            self._window[head] = None
        parent.children[head.tokens[:step]] = head
        node.tokens = node.tokens[k * step:]
        node.slots = node.slots[k:]
        node.hashes = node.hashes[k:]
        node.start_block += k
        node.parent = head
        head.children[node.tokens[:step]] = node
        self.num_nodes += 1
        return head

    def _evictable(self, n: Node) -> bool:
        return n.alive and n.pins == 0 and not n.children and n.parent is not None and bool(n.slots)

    @staticmethod
    def _key(n: Node) -> tuple[int, float]:
        """Main's order: least recently used first, hot (pinned-tier) leaves after every
        ordinary one."""
        return (1 if n.hot else 0, n.last_access_s)

    def _push(self, n: Node) -> None:
        """Queue a main-region leaf as an eviction victim (window leaves are listed
        in the window's LRU order instead)."""
        if n.region != MAIN or n.queued == n.version:
            return  # window leaves are not queued; this version already is
        hot, last = self._key(n)
        n.queued = n.version
        heapq.heappush(self._heap, (hot, last, next(self._seq), n.version, n))
        if len(self._heap) > 4 * self.num_nodes + 1024:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap = []
        for n in self.iter_nodes():
            n.queued = -1
            if n.region == MAIN and self._evictable(n):
                n.queued = n.version
                self._heap.append((*self._key(n), next(self._seq), n.version, n))
        heapq.heapify(self._heap)

    def _drop_empty_root(self, sentinel: Node) -> None:
        if self._roots.get(sentinel.root) is sentinel and not sentinel.children and sentinel.pins == 0:
            del self._roots[sentinel.root]
            sentinel.alive = False

    def _count(self, n: Node, sign: int) -> None:
        self.num_nodes += sign
        self._count_blocks(n, sign * len(n.slots))

    def _count_blocks(self, n: Node, delta: int) -> None:
        self.num_blocks += delta
        self.region_blocks[n.region] += delta
        if n.hot:
            self.hot_blocks += delta
        t, tenants = n.root.tenant, self.tenant_blocks
        left = tenants.get(t, 0) + delta
        if left:
            tenants[t] = left
        else:
            tenants.pop(t, None)
            self.tenant_evictions.pop(t, None)


def _equal_prefix_blocks(edge: bytes, prompt: bytes, offset: int, n: int, block_size: int) -> int:
    """How many of the first n blocks of `edge` equal the prompt's blocks at `offset`."""
    a = np.frombuffer(edge, dtype=np.uint32, count=n * block_size).reshape(n, block_size)
    b = np.frombuffer(prompt, dtype=np.uint32, count=n * block_size, offset=offset).reshape(n, block_size)
    differs = (a != b).any(axis=1)
    return int(differs.argmax()) if differs.any() else n
