"""Hypothesis state machine over LocalCache and its index.

Every stored block's payload names its prefix: bytes derived from (key root, tokens
0..end of the block). So a hit whose materialized bytes all match the payloads of
the LOOKUP's own prefix proves the cache never handed out blocks of another prefix.
Prompts come from a three-token alphabet and blocks are 4 tokens, so prefixes share,
diverge and split edges constantly; the capacity is small, so eviction runs all the time.
The same machine also runs with every block hash forced to one constant (a total
collision): the answers must not change, because matching compares tokens.
"""
from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import xxhash
from hypothesis import HealthCheck, settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

import kvtier.cache as cache_mod
from kvtier.cache import Hit, LocalCache
from kvtier.keys import KeyRoot

B = 4
BLOCK_BYTES = 32
SLOTS = 24
MAX_WALKS = 8
"""Earlier lookups' pinned nodes whose resumed walks are checked after every step."""
ROOTS = [KeyRoot("a", "m", "w1", "fp16", "r", "x"), KeyRoot("b", "m", "w1", "fp16", "r", "x"),
         KeyRoot("a", "m", "w2", "fp16", "r", "x")]

DOCS = [np.random.default_rng(seed).integers(0, 3, 48).astype(np.uint32) for seed in range(3)]


@st.composite
def prompts(draw) -> list[int]:
    """A cut of a shared document, maybe with one token flipped, plus a suffix: prompts
    share prefixes, diverge mid-edge, and repeat."""
    doc = DOCS[draw(st.integers(0, len(DOCS) - 1))]
    tokens = doc[:draw(st.integers(1, len(doc)))].tolist()
    if draw(st.booleans()):
        at = draw(st.integers(0, len(tokens) - 1))
        tokens[at] = (tokens[at] + 1) % 3
    tokens += draw(st.lists(st.integers(0, 2), max_size=8))
    return tokens


prompts = prompts()
roots = st.sampled_from(range(len(ROOTS)))


def payload(root: KeyRoot, tokens: np.ndarray, block: int) -> bytes:
    """The bytes block `block` of this prompt must hold: a function of its whole prefix."""
    ident = root.digest() + tokens[:(block + 1) * B].astype("<u4").tobytes()
    return xxhash.xxh3_128_digest(ident) * (BLOCK_BYTES // 16)


def kv_for(root: KeyRoot, tokens: np.ndarray) -> bytes:
    return b"".join(payload(root, tokens, i) for i in range(len(tokens) // B))


class CacheMachine(RuleBasedStateMachine):
    held = Bundle("held")

    def __init__(self) -> None:
        super().__init__()
        self.cache = LocalCache(SLOTS * BLOCK_BYTES, BLOCK_BYTES, block_size=B, min_sightings=1,
                                drain_budget_s=0, queue_capacity=4)
        self.live: dict[int, tuple[Hit, np.ndarray, list[bytes]]] = {}
        self.walks: list[tuple[KeyRoot, bytes, object]] = []  # (root, prompt bytes, a node its lookup pinned)

    def _remember_walk(self, root: KeyRoot, tokens: np.ndarray, hit) -> None:
        if hit:
            self.walks = self.walks[-(MAX_WALKS - 1):] + [(root, tokens.tobytes(), hit._node)]

    def _check_hit(self, hit: Hit, root: KeyRoot, tokens: np.ndarray, allow_full: bool) -> None:
        assert hit.matched_tokens % B == 0 and hit.matched_tokens > 0
        assert hit.matched_tokens <= len(tokens) if allow_full else hit.matched_tokens < len(tokens)
        dst = bytearray(len(hit.blocks) * BLOCK_BYTES)
        assert self.cache.materialize(hit, dst) == len(dst)
        for i in range(len(hit.blocks)):
            assert dst[i * BLOCK_BYTES:(i + 1) * BLOCK_BYTES] == payload(root, tokens, i), \
                f"block {i} of the hit belongs to another prefix"

    @rule(target=held, r=roots, p=prompts, allow_full=st.booleans())
    def lookup(self, r, p, allow_full):
        root, tokens = ROOTS[r], np.array(p, dtype=np.uint32)
        hit = self.cache.lookup(root, tokens, allow_full=allow_full)
        self._remember_walk(root, tokens, hit)
        if not hit:
            return None
        self._check_hit(hit, root, tokens, allow_full)
        self.live[id(hit)] = (hit, tokens, [payload(root, tokens, i) for i in range(len(hit.blocks))])
        return hit

    @rule(hit=consumes(held))
    def release(self, hit):
        if hit is None:
            return
        self.cache.release(hit)
        del self.live[id(hit)]

    @rule(r=roots, p=prompts)
    def store_zero_copy(self, r, p):
        root, tokens = ROOTS[r], np.array(p, dtype=np.uint32)
        res = self.cache.reserve(root, tokens, force=True)
        if res is None:
            return
        arena = self.cache.arena
        for i, off in enumerate(res.offsets):
            arena[off:off + BLOCK_BYTES] = np.frombuffer(payload(root, tokens, res.first_block + i), np.uint8)
        self.cache.commit(res)

    @rule(r=roots, p=prompts, flush=st.booleans())
    def store_queued(self, r, p, flush):
        root, tokens = ROOTS[r], np.array(p, dtype=np.uint32)
        hit = self.cache.lookup(root, tokens)  # a sighting, as an engine makes
        self._remember_walk(root, tokens, hit)
        self.cache.release(hit)
        self.cache.store(root, tokens, kv_for(root, tokens))
        if flush:
            self.cache.flush()

    @rule(r=roots, p=prompts)
    def abandoned_reservation(self, r, p):
        res = self.cache.reserve(ROOTS[r], np.array(p, dtype=np.uint32), force=True)
        if res is not None:
            self.cache.abort(res)

    @rule(n=st.integers(1, 30))
    def evict(self, n):
        self.cache.evict(n)

    @rule(r=roots)
    def invalidate(self, r):
        self.cache.invalidate(lambda root: root == ROOTS[r])

    @invariant()
    def pinned_blocks_keep_their_bytes(self):
        arena = self.cache.arena
        for hit, _tokens, expected in self.live.values():
            for slot, want in zip(hit.blocks, expected):
                off = self.cache.block_offset(slot)
                assert arena[off:off + BLOCK_BYTES].tobytes() == want, "a pinned block was evicted or reused"

    @invariant()
    def resumed_walks_match_walks_from_the_root(self):
        """A walk resumed at a node an earlier lookup of the same prompt reached
        (`match_after`, used by reserve and commit) finds what a walk from the root
        finds, whatever splits, evictions and invalidations happened since."""
        ix = self.cache._index
        for root, tb, node in self.walks:
            for limit in (len(tb) // (4 * B), len(tb) // (4 * B) - 1):
                resumed = ix.match_after(node, tb, limit)
                if resumed is None:
                    continue
                fresh = ix.match(root, tb, limit)
                assert (resumed.node, resumed.within, resumed.cached_blocks) == \
                    (fresh.node, fresh.within, fresh.cached_blocks)

    @invariant()
    def byte_accounting_is_exact(self):
        ix, pool = self.cache._index, self.cache._pool
        nodes = list(ix.iter_nodes())
        assert ix.num_blocks == sum(len(n.slots) for n in nodes)
        in_index = [s for n in nodes for s in n.slots]
        assert len(in_index) == len(set(in_index))
        assert not any(pool.is_free(s) for s in in_index)
        stats = self.cache.stats()
        assert stats.bytes_used == ix.num_blocks * BLOCK_BYTES
        assert stats.reserved_blocks == 0
        assert pool.free_count + ix.num_blocks + ix.dead_blocks == SLOTS
        assert sum(ix.tenant_blocks.values()) == ix.num_blocks
        for n in nodes:
            assert n.pins >= sum(c.pins for c in n.children.values())
            assert n.pins >= 0

    def teardown(self):
        for hit, _, _ in list(self.live.values()):
            self.cache.release(hit)
        ix = self.cache._index
        assert ix.dead_blocks == 0
        assert all(n.pins == 0 for n in ix.iter_nodes())


CacheMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=50, deadline=None,  # up to 4,000 steps
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCacheNeverServesAnotherPrefix = CacheMachine.TestCase


class CollidingHashMachine(CacheMachine):
    """Every block hash is the same 16 bytes: a forced total collision."""

    def __init__(self) -> None:
        self._saved = cache_mod.chain_hashes
        cache_mod.chain_hashes = lambda parent, tb, bs, first=0, num=None: (
            [b"\xab" * 16] * ((len(tb) // (4 * bs) - first) if num is None else num))
        super().__init__()

    def teardown(self):
        cache_mod.chain_hashes = self._saved
        super().teardown()


CollidingHashMachine.TestCase.settings = settings(
    max_examples=20, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestForcedHashCollisionNeverYieldsWrongKV = CollidingHashMachine.TestCase
