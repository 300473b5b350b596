"""Scheduler-side bookkeeping against a real sidecar: what is offered to vLLM, what
the workers are told to load and store, and that every pin is released."""
from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from kvtier.keys import KeyRoot
from kvtier_sidecar.client import SidecarClient
from kvtier_testenv.polling import wait_for
from kvtier_vllm.lookups import AsyncLookups, Breaker
from kvtier_vllm.plan import PIN_STEPS, LoadSpec, SchedulerBook, StoreSpec, root_fields

BLOCK = 16
# These tests pin the bookkeeping, not the deadline: every lookup is waited for.
PATIENT_S = 30.0
ROOT = KeyRoot("t", "reference-tiny", "dev", "float32", "rope-default", "sdpa")


class CountingClient(SidecarClient):
    """The real client, counting the pins it holds."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.held: set[int] = set()

    def lookup(self, root, token_ids, digests=False, local_tokens=0, purpose=None):
        hit = super().lookup(root, token_ids, digests, local_tokens)
        if hit:
            self.held.add(hit.hit_id)
        return hit

    def release(self, hit) -> None:
        self.held.discard(hit.hit_id)
        super().release(hit)


class PatientBook(SchedulerBook):
    """The connector's book over the lookup thread, each lookup waited for in full."""

    def __init__(self, client, block_size: int, vllm_block_size: int, verify_checksums: bool) -> None:
        super().__init__(AsyncLookups(client, PATIENT_S, Breaker(PATIENT_S)), block_size, vllm_block_size,
                         verify_checksums)

    def matched(self, req_id, root, prompt, local_tokens, wait_s=PATIENT_S):
        return super().matched(req_id, root, prompt, local_tokens, wait_s)


def _released(client: CountingClient, n: int) -> None:
    """Releases run on the lookup thread: wait until n pins are left."""
    wait_for(f"{n} pins held", lambda: len(client.held) == n, 10)


@pytest.fixture()
def stored(spawn, oracle):
    sc = spawn("plan", block_size=BLOCK, min_sightings=1)
    prompt = list(range(1, 5 * BLOCK + 8))
    writer = SidecarClient(sc.socket)
    n = len(prompt) // BLOCK
    blocks = np.zeros((n, writer.connect() and writer.info["block_bytes"]), np.uint8)
    assert not writer.lookup(ROOT, prompt)  # admission counts sightings at lookups, as vLLM's would
    assert writer.store(ROOT, prompt, blocks)
    return sc, prompt


def test_offers_the_hit_beyond_vllms_local_blocks_rounded_to_its_block_size(stored):
    sc, prompt = stored
    book = PatientBook(CountingClient(sc.socket), BLOCK, 2 * BLOCK, verify_checksums=True)
    assert book.matched("r1", ROOT, prompt, 0) == 4 * BLOCK      # 5 blocks hit -> 2 vLLM blocks of 32
    assert book.matched("r1", ROOT, prompt, 2 * BLOCK) == 2 * BLOCK  # asked again: same pinned hit
    book.allocated("r1", [7, 3, 9], 2 * BLOCK)
    specs = book.step_specs(prefill_done=["r1"])
    (load,) = specs.loads
    assert (load.first_block, len(load.slots), load.block_ids) == (2, 2, [7, 3, 9])
    assert load.digests is not None and len(load.digests) == 2
    (store,) = specs.stores
    assert len(store.token_ids) == len(prompt) // BLOCK * BLOCK


def test_pins_are_released_after_the_load_steps_or_at_the_end(stored):
    sc, prompt = stored
    client = CountingClient(sc.socket)
    book = PatientBook(client, BLOCK, BLOCK, verify_checksums=False)
    book.matched("loaded", ROOT, prompt, 0)
    book.allocated("loaded", [1, 2, 3, 4, 5], 5 * BLOCK)
    book.matched("refused", ROOT, prompt, 0)
    book.allocated("refused", [], 0)                # vLLM took none: released at once
    book.matched("aborted", ROOT, prompt, 0)        # never allocated, then aborted
    _released(client, 2)
    for _ in range(PIN_STEPS + 1):
        book.step_specs(prefill_done=[])
    _released(client, 1)                            # the load has certainly run
    book.finished("aborted")
    _released(client, 0)
    assert book.pinned() == 0


def test_a_preempted_request_asked_again_looks_up_afresh(stored):
    sc, prompt = stored
    client = CountingClient(sc.socket)
    book = PatientBook(client, BLOCK, BLOCK, verify_checksums=False)
    book.matched("r", ROOT, prompt, 0)
    book.allocated("r", [1, 2, 3, 4, 5], 5 * BLOCK)
    first = set(client.held)
    assert book.matched("r", ROOT, prompt, 0) == 5 * BLOCK
    wait_for("the first pin released", lambda: len(client.held) == 1 and client.held != first, 10)
    book.finished("r")
    _released(client, 0)


def test_a_sidecar_that_is_gone_offers_nothing(tmp_path):
    book = PatientBook(SidecarClient(str(tmp_path / "absent.sock")), BLOCK, BLOCK, verify_checksums=False)
    assert book.matched("r", ROOT, list(range(100)), 0) == 0
    book.allocated("r", [], 0)
    assert book.step_specs(prefill_done=["r"]).loads == []


def test_a_requests_new_blocks_reach_its_store_and_the_counts_add_up(stored):
    sc, prompt = stored
    client = CountingClient(sc.socket)
    book = PatientBook(client, BLOCK, BLOCK, verify_checksums=False)
    assert book.prompt_len("r") is None
    assert book.matched("r", ROOT, prompt, BLOCK) == 4 * BLOCK  # one block local, four from kvtier
    assert book.prompt_len("r") == len(prompt)
    book.allocated("r", [1, 2], 4 * BLOCK)
    book.blocks_changed("r", [3, 4], replace=False)            # more blocks while it runs
    book.blocks_changed("absent", [9], replace=False)          # an unknown request changes nothing
    (store,) = book.step_specs(prefill_done=["r"]).stores
    assert store.block_ids == [1, 2, 3, 4]
    assert book.step_specs(prefill_done=["r"]).stores == []    # stored once
    book.blocks_changed("r", [7], replace=True)                # resumed: a whole new list
    assert book._requests["r"].block_ids == [7]
    counts = book.take_counts()
    assert (counts["lookups"], counts["prompt_tokens"], counts["local_hit_tokens"], counts["hit_tokens"]) == (
        1, len(prompt), BLOCK, 4 * BLOCK)
    assert set(book.take_counts().values()) == {0}             # taken: they start again
    book.finished("r")
    _released(client, 0)


def test_a_loads_pin_is_held_exactly_pin_steps_steps(stored):
    sc, prompt = stored
    client = CountingClient(sc.socket)
    book = PatientBook(client, BLOCK, BLOCK, verify_checksums=False)
    book.matched("r", ROOT, prompt, 0)
    book.allocated("r", [1, 2, 3, 4, 5], 5 * BLOCK)
    for _ in range(PIN_STEPS):  # the load's step and the ones after it still need the pin
        book.step_specs(prefill_done=[])
    assert book.pinned() == 1
    book.step_specs(prefill_done=[])
    assert book.pinned() == 0
    _released(client, 0)


def test_a_loads_blocks_count_under_the_tier_each_came_from():
    """A "peer" hit whose first blocks the sidecar already held (a partly local hit):
    a load starting past vLLM's own blocks counts the sidecar's own blocks as dram and
    only those from the peer as peer, however many of them it loaded."""
    peer = LoadSpec(req_id="r", instance="i", first_block=2, slots=list(range(8)), block_ids=[0], tier="peer",
                    peer_from_block=5)
    assert peer.blocks_by_tier(8) == {"dram": 3, "peer": 5}
    assert peer.blocks_by_tier(2) == {"dram": 2, "peer": 0}   # a load cut short by a load error
    assert peer.blocks_by_tier(4) == {"dram": 3, "peer": 1}
    whole = peer.model_copy(update={"peer_from_block": 0})
    assert whole.blocks_by_tier(8) == {"dram": 0, "peer": 8}
    dram = LoadSpec(req_id="r", instance="i", first_block=0, slots=[1, 2], block_ids=[0])
    assert dram.blocks_by_tier(2) == {"dram": 2}


def test_a_re_ask_before_allocation_reuses_the_pinned_hit_without_a_second_lookup(stored):
    sc, prompt = stored
    client = CountingClient(sc.socket)
    book = PatientBook(client, BLOCK, BLOCK, verify_checksums=False)
    assert book.matched("r", ROOT, prompt, 0) == 5 * BLOCK
    pins = set(client.held)
    assert book.matched("r", ROOT, prompt, BLOCK) == 4 * BLOCK   # vLLM asks again, its local hit grown
    assert client.held == pins and book.take_counts()["lookups"] == 1
    book.finished("r")
    _released(client, 0)


def test_a_local_hit_as_long_as_kvtiers_or_longer_offers_nothing(stored):
    sc, prompt = stored
    client = CountingClient(sc.socket)
    book = PatientBook(client, BLOCK, BLOCK, verify_checksums=False)
    longer = prompt + list(range(1000, 1000 + 5 * BLOCK))          # kvtier holds its first 5 blocks
    assert book.matched("same", ROOT, longer, 5 * BLOCK) == 0      # vLLM holds those 5 too
    assert book.matched("more", ROOT, longer, 6 * BLOCK) == 0      # vLLM holds 6
    for req_id in ("same", "more"):
        book.allocated(req_id, [1, 2, 3, 4, 5, 6], 0)
    _released(client, 0)


def test_a_load_stays_pinned_through_the_step_vllm_schedules_ahead(stored):
    """Its own step and the one vLLM may schedule while that one runs: released at the third."""
    sc, prompt = stored
    client = CountingClient(sc.socket)
    book = PatientBook(client, BLOCK, BLOCK, verify_checksums=False)
    book.matched("r", ROOT, prompt, 0)
    book.allocated("r", [1, 2, 3, 4, 5], 5 * BLOCK)
    book.step_specs(prefill_done=[])   # the step that loads it
    book.step_specs(prefill_done=[])   # scheduled while the load runs
    assert book.pinned() == 1
    book.step_specs(prefill_done=[])
    assert book.pinned() == 0
    _released(client, 0)


def test_a_load_pinned_for_its_steps_ends_cleanly_when_finished_or_asked_again_meanwhile(stored):
    sc, prompt = stored
    client = CountingClient(sc.socket)
    book = PatientBook(client, BLOCK, BLOCK, verify_checksums=False)
    for req_id in ("done", "preempted"):
        book.matched(req_id, ROOT, prompt, 0)
        book.allocated(req_id, [1, 2, 3, 4, 5], 5 * BLOCK)
    assert len(book.step_specs(prefill_done=[]).loads) == 2
    book.finished("done")                                          # before its load's pin was due
    assert book.matched("preempted", ROOT, prompt, 0) == 5 * BLOCK  # preempted, asked again: a new pin
    _released(client, 1)
    for _ in range(PIN_STEPS):
        book.step_specs(prefill_done=[])
    # the old load's steps are over; the new lookup, not allocated yet, keeps its pin
    assert book.pinned() == 1 and len(client.held) == 1
    book.finished("preempted")
    _released(client, 0)


def test_a_step_stores_each_prompt_with_a_full_block_once_whatever_comes_before_it(stored):
    sc, prompt = stored
    client = CountingClient(sc.socket)
    book = PatientBook(client, BLOCK, BLOCK, verify_checksums=False)
    prompts = {"done": prompt, "short": prompt[: BLOCK - 1], "one": prompt[:BLOCK], "full": prompt}
    for req_id, p in prompts.items():
        book.matched(req_id, ROOT, p, 0)
        book.allocated(req_id, [], 0)
    assert [s.req_id for s in book.step_specs(prefill_done=["done"]).stores] == ["done"]
    stores = book.step_specs(prefill_done=["absent", "done", "short", "one", "full"]).stores
    assert [(s.req_id, len(s.token_ids)) for s in stores] == [("one", BLOCK), ("full", 5 * BLOCK)]
    for req_id in prompts:
        book.finished(req_id)
    _released(client, 0)


class PeerRelabellingClient(CountingClient):
    """The real sidecar's hit, answered as a peer's would be: the sidecar held the first
    `dram_tokens` itself and fetched the rest from a peer."""

    def __init__(self, path: str, dram_tokens: int | None) -> None:
        super().__init__(path)
        self.dram_tokens = dram_tokens

    def lookup(self, root, token_ids, digests=False, local_tokens=0, purpose=None):
        hit = super().lookup(root, token_ids, digests, local_tokens)
        if hit:
            hit.tier, hit.dram_tokens = "peer", self.dram_tokens
        return hit


@pytest.mark.parametrize(("dram_tokens", "peer_from_block", "by_tier"),
                         [(3 * BLOCK, 3, {"dram": 2, "peer": 2}), (None, 0, {"dram": 0, "peer": 4})])
def test_a_peer_hits_load_counts_from_the_first_block_the_sidecar_did_not_hold(stored, dram_tokens,
                                                                                 peer_from_block, by_tier):
    sc, prompt = stored
    client = PeerRelabellingClient(sc.socket, dram_tokens)
    book = PatientBook(client, BLOCK, BLOCK, verify_checksums=False)
    assert book.matched("r", ROOT, prompt, BLOCK) == 4 * BLOCK
    book.allocated("r", [1, 2, 3, 4, 5], 4 * BLOCK)
    (load,) = book.step_specs(prefill_done=[]).loads
    assert (load.tier, load.first_block, load.peer_from_block) == ("peer", 1, peer_from_block)
    assert load.blocks_by_tier(4) == by_tier
    book.finished("r")
    _released(client, 0)


def test_a_peer_load_built_without_its_dram_blocks_counts_every_block_as_the_peers():
    load = LoadSpec(req_id="r", instance="i", first_block=0, slots=[1, 2, 3], block_ids=[0], tier="peer")
    assert load.blocks_by_tier(3) == {"dram": 0, "peer": 3}


def test_the_specs_sent_to_the_workers_cannot_be_changed():
    load = LoadSpec(req_id="r", instance="i", first_block=0, slots=[1], block_ids=[0])
    store = StoreSpec(req_id="r", root=root_fields(ROOT), token_ids=list(range(BLOCK)), block_ids=[0])
    for spec, name, value in ((load, "first_block", 1), (store, "token_ids", [])):
        with pytest.raises(ValidationError):
            setattr(spec, name, value)


def test_a_warmup_request_is_looked_up_as_one_counted_apart_and_still_loads_and_stores(stored):
    """The rollout's warm-up (`kv_transfer_params` marker, read by the connector): its
    lookup carries purpose "warmup" (the sidecar counts it apart), the book counts it in
    warmup_* and in none of the traffic counts it reports as the hit figure's
    denominator, its load is marked so the worker does not report it as a hit, and its
    prompt is stored as any."""
    sc, prompt = stored
    before = sc.stats()
    book = PatientBook(SidecarClient(sc.socket), BLOCK, BLOCK, verify_checksums=False)
    assert SchedulerBook.matched(book, "w1", ROOT, prompt, 0, PATIENT_S, warmup=True) == 5 * BLOCK
    book.allocated("w1", [1, 2, 3, 4, 5, 6], 5 * BLOCK)
    specs = book.step_specs(prefill_done=["w1"])
    (load,) = specs.loads
    assert load.warmup
    (store,) = specs.stores
    assert len(store.token_ids) == len(prompt) // BLOCK * BLOCK
    counts = book.take_counts()
    assert (counts["warmup_lookups"], counts["warmup_prompt_tokens"]) == (1, len(prompt))
    assert (counts["lookups"], counts["prompt_tokens"], counts["hit_tokens"], counts["local_hit_tokens"]) == (0, 0, 0, 0)
    book.finished("w1")
    after = sc.stats()
    assert after["lookups"] == before["lookups"]
    assert after["sidecar"]["warmup_lookups"] == 1
    assert after["sidecar"]["warmup_tokens_hit"] == 5 * BLOCK

    # traffic, the same prompt: counted as ever
    assert book.matched("r1", ROOT, prompt, 0) == 5 * BLOCK
    counts = book.take_counts()
    assert (counts["lookups"], counts["prompt_tokens"], counts["warmup_lookups"]) == (1, len(prompt), 0)
    book.finished("r1")
    assert sc.stats()["lookups"] == before["lookups"] + 1
