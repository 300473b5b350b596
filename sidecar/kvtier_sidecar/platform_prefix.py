"""Platform-owned prefixes (config `platform_prefixes`): a system prompt every tenant
starts with, cached once under the platform tenant's root. A lookup may take those
blocks; a store of a prompt that starts with one mirrors it there (a memcpy inside the
arena). It is the only way one tenant's lookup touches blocks not its own, and only
for token-exact matches of a configured prefix (rule: tokens-not-hashes)."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvtier.keys import KeyRoot
from kvtier.sidecar_config import SidecarConfig

from .dram import DramTier, TierHit


class PlatformPrefixes:
    def __init__(self, tier: DramTier, config: Callable[[], SidecarConfig]) -> None:
        self.tier = tier
        self.config = config  # the current config: prefixes change on a hot apply
        self.block_size = tier.block_size

    def hit(self, root: KeyRoot, tokens: np.ndarray, have: int) -> TierHit | None:
        """A pinned hit on the platform copy when it covers more than `have` blocks."""
        prefix = self.matching(tokens)
        if prefix is None or len(prefix) // self.block_size <= have:
            return None
        # One extra token keeps rule: last-token from trimming the prefix itself.
        hit = self.tier.lookup(self.root_for(root), tokens[: len(prefix) + 1])
        if hit and hit.matched_tokens // self.block_size <= have:
            self.tier.release(hit.handle)
            return None
        return hit

    def matching(self, tokens: np.ndarray) -> np.ndarray | None:
        """The longest configured prefix `tokens` starts with (and goes beyond)."""
        best = None
        for p in self.config().platform_prefixes:
            if len(p) >= self.block_size and len(tokens) > len(p) and np.array_equal(tokens[: len(p)], p):
                if best is None or len(p) > len(best):
                    best = np.asarray(p, dtype=np.uint32)
        return best

    def root_for(self, root: KeyRoot) -> KeyRoot:
        return root.with_tenant(self.config().platform_tenant)

    def mirror(self, root: KeyRoot, tokens: np.ndarray) -> None:
        """Copy a just-stored prompt's platform prefix under the platform root."""
        prefix = self.matching(tokens)
        if prefix is None or root.tenant == self.config().platform_tenant:
            return
        n = len(prefix) // self.block_size
        src = self.tier.lookup(root, tokens[: n * self.block_size + 1])
        if not src:
            return
        try:
            if src.matched_tokens < n * self.block_size:
                return
            res = self.tier.reserve(self.root_for(root), tokens[: n * self.block_size], None, None, admit=False)
            if res is None:
                return
            for i, slot in enumerate(res.slots):
                self.tier.slot_array(slot)[:] = self.tier.slot_array(src.slots[res.first_block + i])
            self.tier.commit(res, len(res.slots))
        finally:
            self.tier.release(src.handle)
