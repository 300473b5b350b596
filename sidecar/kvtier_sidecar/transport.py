"""The peer transport interface: what the sidecar needs from any byte mover.

TCP (`peer_tcp`) implements it today; an RDMA transport would implement the same two
calls. Both ends deal in block runs landing in arena slots the caller reserved, so a
transport that can write into registered memory directly fits without change.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvtier.keys import KeyRoot


class FetchSink(Protocol):
    """Where fetched blocks land. `reserve` is called once the peer announced how many
    blocks it will send; it returns one writable view per block (or None to decline)."""

    def reserve(self, n_blocks: int) -> list[memoryview] | None: ...


# The errors of a fetch that stopped at bytes that failed verification (a peer, or
# something between, serving bad bytes): a block's digest, or a sealed record's tag.
CHECKSUM_MISMATCH = "checksum mismatch"
RECORD_AUTH_FAILED = "record authentication failed"


@dataclass(slots=True)
class FetchOutcome:
    """`verified_blocks` leading blocks were received and passed their checksums.

    `error` names why the transfer stopped early (None when complete); anything after
    the verified prefix must be discarded by the caller.
    """

    announced_blocks: int = 0
    verified_blocks: int = 0
    bytes_received: int = 0
    error: str | None = None
    digests: list[int] = field(default_factory=list)  # xxh3-64 of each verified block


@dataclass(slots=True)
class HotPrefixes:
    prefixes: list[tuple[KeyRoot, np.ndarray]] = field(default_factory=list)


class PeerTransport(Protocol):
    def fetch(self, peer: str, root: KeyRoot, token_ids: np.ndarray, block_size: int,
              block_bytes: int, sink: FetchSink, max_blocks: int, skip_blocks: int = 0,
              deadline: float | None = None) -> FetchOutcome:
        """Never raises; the whole fetch ends by `deadline` (monotonic) whatever the peer does."""

    def hot_prefixes(self, peer: str, tenant: str, max_bytes: int) -> HotPrefixes: ...
