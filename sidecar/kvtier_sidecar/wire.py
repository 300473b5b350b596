"""The peer protocol's bytes: handshake, request and response frames, run frames.

Pure encoding and decoding; the sockets live in `peer_tcp`, the session's sealing in
`peer_session`. One connection:

    client -> server   HELLO    b"KVP3" | client_nonce[16] | id_len u8 | client_id
    server -> client   CHALLENGE b"KVP3" | server_nonce[16] | n u8 | server_proof[32] * n
    client -> server   PROOF    client_proof[32]
    -- from here on every frame travels sealed, one frame per RECORD --
    client -> server   REQUEST  b"KVRQ" | op u8 | body_len u32 | body
    server -> client   RESPONSE b"KVRS" | status u8 | body_len u32 | body(JSON)
    server -> client   RUN*     b"KVRN" | first_block u32 | n_blocks u32 | xxh3_64 u64 * n_blocks
                       then one record per block: its bytes
    RECORD             b"KVSE" | plaintext_len u32 | AES-256-GCM(plaintext) | tag[16]

A server that refuses a connection at the handshake (bad proof, no free slot) answers
with a plain RESPONSE instead of a record: no session exists yet, and the refusal
says nothing an eavesdropper could use.

A FETCH body is `json_len u32 | FetchRequest JSON | token ids (little-endian uint32)`.
The response announces `n_blocks`; RUN frames follow in block order until they add up.
Each run carries its checksums (one xxh3-64 per block, computed once when the block
was stored, not per fetch), so a receiver keeps every block verified before a
corruption or a cut connection: a partial answer is still a correct answer.

The handshake is mutual and bound to its endpoints. A proof is
HMAC-SHA256(secret, context | role | client_nonce | server_nonce | server_endpoint |
client_id): both nonces, so neither side can replay an old proof; the role, so a
server's proof is never a client's (no reflection); the endpoint the client meant to
reach (the address it dialled, which the server checks against the address it
advertises), so a proof a sidecar was lured into making for a fake peer is useless
at the real one (no relay). The server proves first, once per secret it accepts (the
current one and, during a rotation's overlap, the previous one); the client answers
with a secret whose server proof checked out, and sends its request only after the
server proved it holds the secret, so a fake peer learns neither tokens nor tenants.

The magic names the protocol's version: a peer speaking another one is refused at its
first frame (`OldProtocolError` for the previous version, v2, which sent everything
after the handshake in the clear).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import struct
from enum import Enum, IntEnum

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from kvtier.identity import WireRoot  # a key root on this wire: KeyRoot's own wire form
from kvtier.tenants import TenantName

HELLO_MAGIC = b"KVP3"
# Magics of the versions before, refused by name (v2: authenticated, not encrypted).
OLD_HELLO_MAGICS = {b"KVP2": 2, b"KVP1": 1}
NONCE_BYTES = 16
PROOF_BYTES = 32
PROOF_CONTEXT = b"kvtier-peer-v3"
RECORD = struct.Struct("<4sI")
RECORD_MAGIC = b"KVSE"
TAG_BYTES = 16
# Identities are host:port strings; one length byte bounds what a server buffers.
MAX_IDENTITY_BYTES = 255
# Secrets a server proves with at once: the current one and the previous one during
# a rotation's overlap; a challenge announcing more is not this protocol.
MAX_PROOFS = 2
HELLO = struct.Struct("<4s16sB")
CHALLENGE = struct.Struct("<4s16sB")
REQUEST = struct.Struct("<4sBI")
REQUEST_MAGIC = b"KVRQ"
RESPONSE = struct.Struct("<4sBI")
RESPONSE_MAGIC = b"KVRS"
RUN = struct.Struct("<4sII")
RUN_MAGIC = b"KVRN"
# 2M tokens of ids plus headers: larger than any real prompt, small enough that a
# malicious length cannot make the server allocate much.
MAX_REQUEST_BYTES = 8 << 20
MAX_RESPONSE_JSON_BYTES = 16 << 20
# Blocks per run frame, at most: bounds what a run header can make a receiver read.
MAX_RUN_BLOCKS = 1 << 16
# A run is cut into chunks of at most this many bytes: each chunk is verified on its
# own (finer-grained partial answers) and hashing overlaps with the kernel's buffering.
RUN_CHUNK_BYTES = 4 << 20


class Op(IntEnum):
    FETCH = 1
    HOT = 2


class Status(IntEnum):
    OK = 0
    MISS = 1
    BAD_REQUEST = 2
    BUSY = 3
    UNAUTHORIZED = 4


class ProtocolError(ValueError):
    """The other side sent bytes that are not this protocol."""


class OldProtocolError(ProtocolError):
    """The other side speaks an earlier version of the peer protocol."""


class FetchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    root: WireRoot
    block_bytes: int = Field(ge=1)
    block_size: int = Field(ge=1)
    max_blocks: int = Field(ge=0, default=1 << 30)
    skip_blocks: int = Field(ge=0, default=0)  # leading blocks the requester already holds


class FetchHeader(BaseModel):
    model_config = ConfigDict(extra="forbid")

    matched_tokens: int = Field(ge=0)
    n_blocks: int = Field(ge=0)
    block_bytes: int = Field(ge=1)


class HotRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: TenantName
    # A budget of nothing is a caller's bug, as on the control API's warm-up.
    max_bytes: StrictInt = Field(gt=0)


class HotPrefix(BaseModel):
    root: WireRoot
    tokens: list[int]


class HotResponse(BaseModel):
    prefixes: list[HotPrefix]


class Role(bytes, Enum):
    SERVER = b"S"
    CLIENT = b"C"


def field_bytes(raw: bytes) -> bytes:
    """`raw`, length-prefixed: a list of such fields signs (or keys) unambiguously."""
    return struct.pack("<H", len(raw)) + raw


def proof(secret: bytes, role: Role, client_nonce: bytes, server_nonce: bytes, server_endpoint: str,
          client_id: str) -> bytes:
    """The MAC one side sends: every field length-prefixed, so no two field lists
    produce the same signed bytes."""
    material = (PROOF_CONTEXT + role.value + field_bytes(client_nonce) + field_bytes(server_nonce)
                + field_bytes(server_endpoint.encode()) + field_bytes(client_id.encode()))
    return hmac.new(secret, material, hashlib.sha256).digest()


def proof_matches(secrets: list[bytes], got: bytes, role: Role, client_nonce: bytes, server_nonce: bytes,
                  server_endpoint: str, client_id: str) -> bytes | None:
    """The secret among `secrets` that produced `got`, or None."""
    for secret in secrets:
        if hmac.compare_digest(proof(secret, role, client_nonce, server_nonce, server_endpoint, client_id), got):
            return secret
    return None


def encode_hello(client_nonce: bytes, client_id: str) -> bytes:
    raw = client_id.encode()
    if len(raw) > MAX_IDENTITY_BYTES:
        raise ProtocolError(f"client identity longer than {MAX_IDENTITY_BYTES} bytes")
    return HELLO.pack(HELLO_MAGIC, client_nonce, len(raw)) + raw


def decode_hello_head(raw: bytes) -> tuple[bytes, int]:
    """(client_nonce, identity length) from HELLO's fixed part."""
    magic, nonce, id_len = HELLO.unpack(raw)
    if magic in OLD_HELLO_MAGICS:
        raise OldProtocolError(f"peer speaks kvtier peer protocol v{OLD_HELLO_MAGICS[magic]}; this sidecar "
                               f"speaks v3 (encrypted): run one sidecar version across the fleet")
    if magic != HELLO_MAGIC:
        raise ProtocolError("not the kvtier peer protocol (bad hello magic)")
    return nonce, id_len


def decode_identity(raw: bytes) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise ProtocolError("client identity is not UTF-8") from None


def encode_challenge(server_nonce: bytes, proofs: list[bytes]) -> bytes:
    return CHALLENGE.pack(HELLO_MAGIC, server_nonce, len(proofs)) + b"".join(proofs)


def decode_challenge_head(raw: bytes) -> tuple[bytes, int]:
    """(server_nonce, number of proofs) from CHALLENGE's fixed part."""
    magic, nonce, n = CHALLENGE.unpack(raw)
    if magic in OLD_HELLO_MAGICS:
        raise OldProtocolError(f"peer speaks kvtier peer protocol v{OLD_HELLO_MAGICS[magic]}, not v3")
    if magic != HELLO_MAGIC:
        raise ProtocolError("peer did not greet with the kvtier peer protocol")
    if not 0 < n <= MAX_PROOFS:
        raise ProtocolError(f"challenge with {n} proofs")
    return nonce, n


def decode_record_header(raw: bytes, max_bytes: int) -> int:
    """A sealed record's plaintext length (its ciphertext and tag follow)."""
    magic, length = RECORD.unpack(raw)
    if magic != RECORD_MAGIC:
        raise ProtocolError("bad record magic")
    if length > max_bytes:
        raise ProtocolError(f"record of {length} bytes exceeds {max_bytes}")
    return length


def _unpack(frame: struct.Struct, raw: bytes, what: str) -> tuple:
    """`frame`'s fields from `raw`; ProtocolError when `raw` is short (a sealed record
    may hold fewer bytes than the frame it claims to be)."""
    if len(raw) != frame.size:
        raise ProtocolError(f"{what} of {len(raw)} bytes, not {frame.size}")
    return frame.unpack(raw)


def encode_request(op: Op, body: bytes) -> bytes:
    return REQUEST.pack(REQUEST_MAGIC, int(op), len(body)) + body


def decode_request_header(raw: bytes) -> tuple[Op, int]:
    magic, op, length = _unpack(REQUEST, raw, "request header")
    if magic != REQUEST_MAGIC:
        raise ProtocolError("bad request magic")
    try:
        parsed = Op(op)
    except ValueError:
        raise ProtocolError(f"unknown op {op}") from None
    if length > MAX_REQUEST_BYTES:
        raise ProtocolError(f"request of {length} bytes exceeds {MAX_REQUEST_BYTES}")
    return parsed, length


def encode_fetch(request: FetchRequest, token_ids: np.ndarray) -> bytes:
    head = request.model_dump_json().encode()
    tokens = np.ascontiguousarray(token_ids, dtype="<u4").tobytes()
    return encode_request(Op.FETCH, struct.pack("<I", len(head)) + head + tokens)


def decode_fetch(body: bytes) -> tuple[FetchRequest, np.ndarray]:
    if len(body) < 4:
        raise ProtocolError("fetch body too short")
    (head_len,) = struct.unpack_from("<I", body)
    if head_len > len(body) - 4:
        raise ProtocolError("fetch header length exceeds body")
    try:
        request = FetchRequest.model_validate_json(body[4 : 4 + head_len])
    except ValueError as exc:
        raise ProtocolError(f"bad fetch request: {exc.__class__.__name__}") from None
    tail = body[4 + head_len :]
    if len(tail) % 4:
        raise ProtocolError("token ids are not a whole number of uint32")
    return request, np.frombuffer(tail, dtype="<u4").astype(np.uint32)


def encode_response(status: Status, payload: BaseModel | dict) -> bytes:
    body = payload.model_dump_json().encode() if isinstance(payload, BaseModel) else json.dumps(payload).encode()
    return RESPONSE.pack(RESPONSE_MAGIC, int(status), len(body)) + body


def decode_response_header(raw: bytes) -> tuple[Status, int]:
    magic, status, length = _unpack(RESPONSE, raw, "response header")
    if magic != RESPONSE_MAGIC:
        raise ProtocolError("bad response magic")
    if length > MAX_RESPONSE_JSON_BYTES:
        raise ProtocolError("response header too large")
    try:
        return Status(status), length
    except ValueError:
        raise ProtocolError(f"unknown status {status}") from None


def encode_run_header(first_block: int, digests: np.ndarray) -> bytes:
    """Header of a run of len(digests) blocks starting at `first_block`."""
    return RUN.pack(RUN_MAGIC, first_block, len(digests)) + np.asarray(digests, dtype="<u8").tobytes()


def decode_run_header(raw: bytes) -> tuple[int, int]:
    """(first_block, n_blocks); the n_blocks * 8 bytes of digests follow."""
    magic, first, count = _unpack(RUN, raw, "run header")
    if magic != RUN_MAGIC:
        raise ProtocolError("bad run magic")
    if not 0 < count <= MAX_RUN_BLOCKS:
        raise ProtocolError(f"run of {count} blocks")
    return first, count


# The largest record either side accepts, unless it expects a block's exact length.
MAX_REQUEST_RECORD_BYTES = REQUEST.size + MAX_REQUEST_BYTES
MAX_RESPONSE_RECORD_BYTES = RESPONSE.size + MAX_RESPONSE_JSON_BYTES
MAX_RUN_RECORD_BYTES = RUN.size + 8 * MAX_RUN_BLOCKS


def chunk_blocks(block_bytes: int) -> int:
    """Blocks per run chunk: RUN_CHUNK_BYTES worth, at least one."""
    return max(1, RUN_CHUNK_BYTES // block_bytes)
