"""One request as routers and caches see it, and its block hashes, computed once.

Hashes are the real chained block hashes (`kvtier.keys`), at the simulation's block
size. A template's full blocks are hashed once per key root and reused: every
request of that template shares them, and only the blocks after it are chained on.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvtier.keys import BlockHash, KeyRoot, chain_hashes


@dataclass(slots=True)
class SimRequest:
    """A request in flight through the event loop (one object, reused per request).

    `tokens` are simulation elements; `prompt_tokens` is in real tokens. `session`
    is -1 for requests outside a conversation. `hashes` is filled only when some
    consumer (a prefix-aware router, the LRU baseline, the oracle) needs them.
    """

    index: int = 0
    time_s: float = 0.0
    tenant: int = 0
    tenant_name: str = ""
    session: int = -1
    template_key: int = 0
    template_elems: int = 0
    tokens: np.ndarray | None = None
    token_bytes: bytes = b""
    prompt_tokens: int = 0
    output_tokens: int = 0
    hash_cache: HashCache | None = None
    _hashes: dict = field(default_factory=dict)

    def hashes(self, root: KeyRoot) -> list[BlockHash]:
        """The prompt's full-block hashes under `root` (computed once per root)."""
        out = self._hashes.get(root)
        if out is None:
            out = self.hash_cache.hashes(root, self.token_bytes, self.template_key, self.template_elems)
            self._hashes[root] = out
        return out


class HashCache:
    """Chained block hashes of prompts, reusing each template's full-block prefix."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._prefix: dict[tuple[KeyRoot, int], list[BlockHash]] = {}

    def hashes(self, root: KeyRoot, token_bytes: bytes, template_key: int, template_elems: int) -> list[BlockHash]:
        """All full-block hashes of the prompt whose first `template_elems` elements
        are the template `template_key` of `root`'s tenant."""
        key = (root, template_key)
        head = self._prefix.get(key)
        if head is None:
            full = template_elems // self.block_size
            head = chain_hashes(root.digest(), token_bytes, self.block_size, 0, full)
            self._prefix[key] = head
        parent = head[-1] if head else root.digest()
        return head + chain_hashes(parent, token_bytes, self.block_size, len(head))
