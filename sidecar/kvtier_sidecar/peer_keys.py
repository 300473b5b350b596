"""The peer secrets a sidecar accepts: the current one and, for a bounded overlap after
a rotation, the previous one.

A Kubernetes Secret mounted as a volume reaches each pod's file at a different moment
(the kubelet's sync period plus its cache TTL), so for a while some sidecars hold the
new secret and some the old. During the overlap a sidecar proves and checks with both;
a handshake succeeds as long as the two ends share one. `PeerKeyring` is pure (the
caller passes the clock); `SecretFileWatch` is the thin file-reading side. Neither ever
holds a secret shorter than `MIN_PEER_SECRET_BYTES`: an empty key would let anyone in.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kvtier.sidecar_config import PeerSecretError, check_peer_secret

log = logging.getLogger("kvtier.sidecar.peer")


@dataclass(frozen=True, slots=True)
class _State:
    current: bytes
    previous: bytes | None = None
    previous_until: float = 0.0


class PeerKeyring:
    """Thread-safe: the peer server, the fetch threads and the reloader share one.
    Every secret it holds passed `check_peer_secret` (PeerSecretError otherwise)."""

    def __init__(self, secret: bytes, overlap_s: float) -> None:
        self.overlap_s = overlap_s
        self._state = _State(check_peer_secret(secret, "given"))
        self._lock = threading.Lock()

    def accepted(self, now: float | None = None) -> list[bytes]:
        """Secrets to prove and check with, the current one first."""
        s = self._state
        now = time.monotonic() if now is None else now
        if s.previous is not None and now < s.previous_until:
            return [s.current, s.previous]
        return [s.current]

    def rotate(self, secret: bytes, now: float | None = None) -> bool:
        """Make `secret` current; the old one stays accepted for `overlap_s`.
        False (and nothing changes) when it already is the current secret."""
        new = check_peer_secret(secret, "rotated to")
        now = time.monotonic() if now is None else now
        with self._lock:
            if new == self._state.current:
                return False
            self._state = _State(new, self._state.current, now + self.overlap_s)
            return True


class SecretFileWatch:
    """Rotates a keyring when the secret file's content changes (a mounted Secret is
    replaced by an atomic symlink swap, so its stamp changes with it)."""

    def __init__(self, path: str | None, keyring: PeerKeyring) -> None:
        self.path = path
        self.keyring = keyring
        self._stamp = self._stat()

    def _stat(self) -> tuple | None:
        if not self.path:
            return None
        try:
            st = os.stat(self.path)
            return (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            return None

    def poll(self) -> bool:
        """Re-read the file if it changed; True when the secret rotated. A missing,
        empty or short file keeps the running secret (a half-written Secret never locks
        peers out, and a truncated one never opens them up)."""
        stamp = self._stat()
        if stamp == self._stamp or stamp is None:
            return False
        self._stamp = stamp
        try:
            secret = Path(self.path).read_bytes().strip()
        except OSError:
            return False
        try:
            return self.keyring.rotate(secret)
        except PeerSecretError as exc:
            if secret:  # an empty file is a Secret being replaced: nothing to say yet
                log.warning("peer secret file changed to an unusable secret; keeping the running one",
                            extra={"error": str(exc)})
            return False
