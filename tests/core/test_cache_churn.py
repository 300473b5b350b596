"""Randomized churn against `LocalCache` with real bytes: lookups held across other
operations, queued stores, zero-copy reserve/write/commit (whole, partial, aborted,
forced), invalidation and forced eviction, under every policy variant and tiny
capacities. Every hit's bytes are checked against what prefill of exactly those
tokens yields, when it is handed out and again when it is released, and every slot
has exactly one owner (index, reservation, a dead node still read, or free)."""
import hashlib
import random

import numpy as np
import pytest

from kvtier.cache import Hit, LocalCache
from kvtier.eviction import EvictionConfig
from kvtier.keys import KeyRoot
from kvtier.sim.tuners import ADAPTATIONS

BS = 4
BB = 32
# Tiny vocabulary and templates: prompts share prefixes and split edges constantly.
VOCAB = 6
STEPS = 2500
SEEDS = range(8)
# Held hits per run before the oldest is released: pins pile up while eviction runs.
MAX_HELD = 6


def prefill(root: KeyRoot, tokens: list[int]) -> np.ndarray:
    """Block i: a pure function of the root and tokens [0, (i + 1) * BS)."""
    arr = np.asarray(tokens, dtype=np.uint32)
    out = [hashlib.blake2b(root.tenant.encode() + arr[: (i + 1) * BS].tobytes(), digest_size=BB).digest()
           for i in range(len(tokens) // BS)]
    return np.frombuffer(b"".join(out), dtype=np.uint8)


def assert_one_owner_per_slot(cache: LocalCache) -> None:
    owned = [s for n in cache._index.iter_nodes() for s in n.slots]
    owned += [s for r in cache._reservations.values() for s in r.slots]
    owned += [s for s in range(cache.num_slots) if cache._pool.is_free(s)]
    assert len(owned) == len(set(owned)), "a slot has two owners"
    assert len(owned) + cache._index.dead_blocks == cache.num_slots


class Churn:
    def __init__(self, seed: int) -> None:
        self.rng = rng = random.Random(seed)
        self.seed = seed
        policy = EvictionConfig(window_fraction=rng.choice([0.0, 0.01, 0.2, 1.0]), adapt=rng.choice(ADAPTATIONS),
                              doorkeeper=rng.random() < 0.5, duel=rng.random() < 0.7)
        self.cache = LocalCache(rng.choice([6, 12, 24, 64]) * BB, BB, BS, min_sightings=rng.choice([1, 2, 3]),
                                drain_budget_s=rng.choice([0.0, 0.0005]), policy=policy)
        self.roots = [KeyRoot(f"t{i}", "m", "v", "f32", "rope", "sdpa") for i in range(3)]
        self.templates = [[rng.randrange(VOCAB) for _ in range(rng.randint(4, 40))] for _ in range(12)]
        self.held: list[tuple[Hit, KeyRoot, list[int]]] = []
        self.open: list[tuple[object, np.ndarray]] = []

    def prompt(self) -> tuple[KeyRoot, list[int]]:
        t = self.rng.choice(self.templates)
        tail = [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(0, 12))]
        return self.rng.choice(self.roots), t[: self.rng.randint(1, len(t))] + tail

    def check(self, hit: Hit, root: KeyRoot, tokens: list[int], when: str) -> None:
        dst = np.empty(len(hit.blocks) * BB, dtype=np.uint8)
        self.cache.materialize(hit, dst)
        assert np.array_equal(dst, prefill(root, tokens)[: len(dst)]), f"seed {self.seed}: wrong KV {when}"

    def release_one(self, i: int) -> None:
        hit, root, tokens = self.held.pop(i)
        self.check(hit, root, tokens, "at release")
        self.cache.release(hit)

    def step(self) -> None:
        rng, cache = self.rng, self.cache
        root, tokens = self.prompt()
        op = rng.random()
        if op < 0.35:
            hit = cache.lookup(root, tokens, allow_full=rng.random() < 0.3)
            if isinstance(hit, Hit):
                self.check(hit, root, tokens, "at lookup")
                self.held.append((hit, root, tokens)) if rng.random() < 0.5 else cache.release(hit)
        elif op < 0.6:
            cache.store(root, tokens, prefill(root, tokens))
        elif op < 0.75:
            res = cache.reserve(root, tokens, force=rng.random() < 0.2)
            if res is not None:
                self.open.append((res, prefill(root, tokens)))
        elif op < 0.85 and self.open:
            self.finish(*self.open.pop(rng.randrange(len(self.open))))
        elif op < 0.93 and self.held:
            self.release_one(rng.randrange(len(self.held)))
        elif op < 0.95:
            cache.drain(None)
        elif op < 0.96:
            cache.invalidate(lambda r, victim=rng.choice(self.roots): r == victim)
        elif op < 0.98:
            cache.evict(rng.randint(1, 5))
        if len(self.held) > MAX_HELD:
            self.release_one(0)

    def finish(self, res, kv: np.ndarray) -> None:
        """Write the reserved blocks, then commit all, a prefix, or abort."""
        if res.done:
            return
        for i, off in enumerate(res.offsets):
            b = res.first_block + i
            self.cache.arena[off:off + BB] = kv[b * BB:(b + 1) * BB]
        if self.rng.random() < 0.15:
            self.cache.abort(res)
        else:
            partial = self.rng.random() < 0.3
            self.cache.commit(res, self.rng.randint(0, res.num_blocks) if partial else None)


@pytest.mark.parametrize("seed", SEEDS)
def test_every_hit_under_random_churn_holds_exactly_its_tokens_kv(seed):
    churn = Churn(seed)
    for i in range(STEPS):
        churn.step()
        if i % 7 == 0:
            assert_one_owner_per_slot(churn.cache)
    while churn.held:
        churn.release_one(0)
    assert_one_owner_per_slot(churn.cache)
    assert churn.cache.stats().hits > 0
