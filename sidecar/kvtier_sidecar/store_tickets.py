"""The book of open stores: the engine asks for slots, writes its KV into the arena,
then commits. All TP ranks of one prompt share one ticket (same root, tokens and TP
degree); the blocks become visible only when every rank 0..tp-1 committed its shard
(rule: all-ranks-commit). Each rank belongs to the engine connection (`owner`) that
began it: a commit for a rank nobody began, or from another connection, and an abort
from a connection that joined no rank, raise `OwnershipError` and change nothing.
A ticket left open past `STORE_TICKET_TIMEOUT_S` is aborted.

A ticket is good only at the sidecar process that issued it: ids start at a random
offset in each process, so a ticket (or a hit) of a predecessor names nothing here
(the client also refuses to send one across a reconnect). Its slots are stamped
unwritten when reserved, and the last rank's commit publishes only the leading blocks
whose stamps were all overwritten (`DramTier.written_blocks`): committing without
writing publishes nothing."""
from __future__ import annotations

import itertools
import secrets
import time
from dataclasses import dataclass, field
from typing import NewType

import numpy as np

from kvtier.keys import KeyRoot

from .dram import DramTier, Reservation
from .metrics import TenantMetrics

TicketId = NewType("TicketId", int)
# The ticket number that means "declined: nothing to write".
DECLINED = TicketId(0)
# A multi-rank store whose ranks have not all committed by then is abandoned.
STORE_TICKET_TIMEOUT_S = 10.0
# Ticket and hit ids start at a random offset below this in each process; at 2**62 the
# chance that a predecessor's id is live here is nil.
ID_OFFSET_RANGE = 1 << 62


def fresh_ids():
    """Increasing ids starting at a random offset (one sequence per sidecar process)."""
    return itertools.count(secrets.randbelow(ID_OFFSET_RANGE) + 1)


@dataclass(slots=True)
class StoreTicket:
    root: KeyRoot
    tokens: np.ndarray
    reservation: Reservation
    tp: int
    created_s: float
    ranks: dict[int, object]  # rank -> the engine connection that began it
    committed_ranks: set[int] = field(default_factory=set)


class OwnershipError(ValueError):
    """An engine connection named a hit, ticket or rank it does not hold."""


@dataclass(frozen=True, slots=True)
class CommitStep:
    """What one rank's commit did: `ok` is the engine's answer; `committed_blocks` > 0
    only on the last rank's commit, with the completed `ticket`."""

    ok: bool
    ticket: StoreTicket | None = None
    committed_blocks: int = 0
    unwritten_blocks: int = 0  # blocks refused because the engine never wrote them


class TicketBook:
    def __init__(self, tier: DramTier, metrics: TenantMetrics) -> None:
        self.tier = tier
        self.metrics = metrics
        self._tickets: dict[TicketId, StoreTicket] = {}
        self._by_key: dict[tuple, TicketId] = {}
        self._ids = fresh_ids()

    def begin(self, root: KeyRoot, tokens: np.ndarray, tp: int, rank: int,
              owner: object = None) -> tuple[TicketId, int, list[int]]:
        """(ticket, first_block, slots) for the engine to write; DECLINED: nothing to write
        (with first_block = the prompt's full blocks when they are all cached already)."""
        if tp < 1 or not (0 <= rank < tp) or self.tier.kv_heads % tp:
            raise ValueError(f"tp={tp} rank={rank} does not divide {self.tier.kv_heads} kv heads")
        key = (root, tokens.tobytes(), tp)
        ticket_id = self._by_key.get(key)
        if ticket_id is not None and ticket_id in self._tickets:
            t = self._tickets[ticket_id]
            if t.ranks.setdefault(rank, owner) is not owner:
                raise OwnershipError(f"rank {rank} of this store was begun by another engine connection")
            return ticket_id, t.reservation.first_block, t.reservation.slots
        reservation = self.tier.reserve(root, tokens, None, None, admit=True)
        if reservation is None:
            # Nothing to write because every block is cached already is no refusal.
            cached = self.tier.holds_all(root, tokens)
            self.metrics.store(root.tenant, False, cached=cached)
            return DECLINED, len(tokens) // self.tier.block_size if cached else 0, []
        self.metrics.store(root.tenant, True)
        self.tier.stamp(reservation.slots, tp)
        ticket_id = TicketId(next(self._ids))
        self._tickets[ticket_id] = StoreTicket(root, tokens.copy(), reservation, tp, time.monotonic(), {rank: owner})
        self._by_key[key] = ticket_id
        return ticket_id, reservation.first_block, reservation.slots

    def commit_rank(self, ticket_id: TicketId, rank: int, owner: object = None) -> CommitStep:
        t = self._tickets.get(ticket_id)
        if t is None:
            return CommitStep(False)
        if rank not in t.ranks or t.ranks[rank] is not owner:
            raise OwnershipError(f"ticket {ticket_id} rank {rank} was not begun by this engine connection")
        t.committed_ranks.add(rank)
        if t.committed_ranks != set(range(t.tp)):
            return CommitStep(True)
        self._forget(ticket_id)
        slots = t.reservation.slots
        written = self.tier.written_blocks(slots, t.tp)
        committed = self.tier.commit(t.reservation, written)
        return CommitStep(committed > 0, t, committed, len(slots) - written)

    def abort(self, ticket_id: TicketId, owner: object = None, expired: bool = False) -> None:
        """Give up a store: a connection that joined it, or the expiry sweep."""
        t = self._tickets.get(ticket_id)
        if t is not None and not expired and not any(o is owner for o in t.ranks.values()):
            raise OwnershipError(f"ticket {ticket_id} belongs to another engine connection")
        if t is not None:
            self._forget(ticket_id)
            self.tier.abort(t.reservation)

    def _forget(self, ticket_id: TicketId) -> None:
        t = self._tickets.pop(ticket_id)
        self._by_key.pop((t.root, t.tokens.tobytes(), t.tp), None)

    def expire(self) -> int:
        now = time.monotonic()
        stale = [tid for tid, t in self._tickets.items() if now - t.created_s > STORE_TICKET_TIMEOUT_S]
        for tid in stale:
            self.abort(tid, expired=True)
        return len(stale)
