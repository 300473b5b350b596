"""The peer session: what keeps the bytes after the handshake confidential and
tamper-evident.

Both ends of an authenticated connection hold the secret that proved it and the
handshake's transcript (both nonces, the endpoint the client dialled, the client's
identity). HKDF-SHA256 over them gives two AES-256-GCM keys, one per direction, new
for every connection (the nonces are). Every frame after the client's proof is one
record (`wire.RECORD`), sealed under its direction's key with a 96-bit nonce that
counts the direction's records from 0 (never sent: each side counts) and the record's
header as associated data. A record changed, cut, dropped, reordered or replayed
(within its connection or into another) fails its tag; the receiver stops there, and
the connection is over. Pure: no sockets (`peer_tcp` moves the records).
"""
from __future__ import annotations

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from . import wire

SESSION_CONTEXT = b"kvtier-peer-v3 session keys"
KEY_BYTES = 32  # AES-256
NONCE_PREFIX = bytes(4)  # the 96-bit GCM nonce: 4 zero bytes, then the record counter (u64)
# A direction's records, at most: its counter must never wrap (a repeated nonce would
# undo GCM). No connection comes near it; past it the connection ends.
MAX_RECORDS = 1 << 63


class RecordAuthError(wire.ProtocolError):
    """A sealed record failed its tag: changed, replayed, reordered or not ours."""


def _hkdf_sha256(secret: bytes, salt: bytes, info: bytes, length: int) -> bytes:
    """HKDF (RFC 5869) with SHA-256, from the `cryptography` package."""
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(secret)


def derive_keys(secret: bytes, client_nonce: bytes, server_nonce: bytes, server_endpoint: str,
                client_id: str) -> tuple[bytes, bytes]:
    """(client-to-server key, server-to-client key) for one connection's handshake."""
    info = (SESSION_CONTEXT + wire.field_bytes(server_endpoint.encode()) + wire.field_bytes(client_id.encode()))
    okm = _hkdf_sha256(secret, client_nonce + server_nonce, info, 2 * KEY_BYTES)
    return okm[:KEY_BYTES], okm[KEY_BYTES:]


class _Direction:
    """One direction's cipher and record counter."""

    __slots__ = ("aead", "records")

    def __init__(self, key: bytes) -> None:
        self.aead = AESGCM(key)
        self.records = 0

    def nonce(self) -> bytes:
        if self.records >= MAX_RECORDS:
            raise wire.ProtocolError("session used up its record counter")
        n = NONCE_PREFIX + self.records.to_bytes(8, "little")
        self.records += 1
        return n


class PeerSession:
    """One connection's two directions. A session is used by one thread at a time (the
    connection's), in record order on each side."""

    __slots__ = ("_send", "_recv")

    def __init__(self, send_key: bytes, recv_key: bytes) -> None:
        self._send = _Direction(send_key)
        self._recv = _Direction(recv_key)

    @classmethod
    def for_client(cls, secret: bytes, client_nonce: bytes, server_nonce: bytes, server_endpoint: str,
                   client_id: str) -> "PeerSession":
        c2s, s2c = derive_keys(secret, client_nonce, server_nonce, server_endpoint, client_id)
        return cls(c2s, s2c)

    @classmethod
    def for_server(cls, secret: bytes, client_nonce: bytes, server_nonce: bytes, server_endpoint: str,
                   client_id: str) -> "PeerSession":
        c2s, s2c = derive_keys(secret, client_nonce, server_nonce, server_endpoint, client_id)
        return cls(s2c, c2s)

    # -- sending --------------------------------------------------------------------------

    def seal(self, plaintext: bytes | memoryview) -> bytes:
        """The whole record (header, ciphertext, tag) for `plaintext`."""
        out = bytearray(sealed_size(len(plaintext)))
        self.seal_into(plaintext, memoryview(out))
        return bytes(out)

    def seal_into(self, plaintext: bytes | memoryview, out: memoryview) -> int:
        """Write the record for `plaintext` at the start of `out`; its length."""
        n = len(plaintext)
        wire.RECORD.pack_into(out, 0, wire.RECORD_MAGIC, n)
        end = wire.RECORD.size + n + wire.TAG_BYTES
        self._send.aead.encrypt_into(self._send.nonce(), plaintext, out[: wire.RECORD.size],
                                     out[wire.RECORD.size:end])
        return end

    # -- receiving ------------------------------------------------------------------------

    def open(self, header: bytes | memoryview, sealed: bytes | memoryview) -> bytes:
        """The plaintext of a record: `header` as received, `sealed` its ciphertext and tag."""
        try:
            return self._recv.aead.decrypt(self._recv.nonce(), bytes(sealed), bytes(header))
        except InvalidTag:
            raise RecordAuthError("a sealed record failed authentication") from None

    def open_into(self, header: bytes | memoryview, sealed: bytes | memoryview, out: memoryview) -> None:
        """Decrypt straight into `out` (exactly the plaintext's length). On a failed tag
        `out` holds unauthenticated bytes: the caller must discard it."""
        try:
            self._recv.aead.decrypt_into(self._recv.nonce(), sealed, header, out)
        except InvalidTag:
            raise RecordAuthError("a sealed record failed authentication") from None


def sealed_size(plaintext_bytes: int) -> int:
    """Bytes on the wire for a record of `plaintext_bytes`."""
    return wire.RECORD.size + plaintext_bytes + wire.TAG_BYTES
