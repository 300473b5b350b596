"""Cache keys: the key root and chained block hashes (rule: key-root, rule:
chained-hashes, rule: tokens-not-hashes; the rules are in docs/ARCHITECTURE.md).

A block's identity is its key root plus every token from position 0 to the end of
the block:

    block_hash[0] = H(root.digest() || tokens[0:B])
    block_hash[i] = H(block_hash[i-1] || tokens[iB:(i+1)B])

The key root's fields are named here and nowhere else: every process boundary carries
a root as `KeyRoot.to_wire()` (a JSON object of those fields) and reads it back with
`KeyRoot.from_wire` (validated: `kvtier.identity.WireRoot`); `kvtier.identity.ModelIdentity`
is the root minus the tenant, the one model identity the connector, the sidecar config
and the policy use. (Those are pydantic models, kept out of this compiled module.)

H is xxh3-128 under a fixed, versioned seed over a canonical encoding (token ids as
little-endian uint32), so the same prompt names the same blocks in every process, on
every host and across releases. Python's `hash()` is never involved.

Hashes NAME blocks (the global index, peer fetches); they never decide a local match.
The local index compares tokens (see `kvtier.radix`), so a collision costs a wasted
fetch, never wrong KV.
"""
from __future__ import annotations

import array
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, NewType

import numpy as np
import xxhash

if TYPE_CHECKING:
    from kvtier.identity import ModelIdentity

BlockHash = NewType("BlockHash", bytes)
"""16-byte xxh3-128 digest of one block, chained through every block before it."""

DEFAULT_BLOCK_SIZE = 16
"""Tokens per block: matches the paged-attention block size, so a match is a whole
number of engine pages (a 1,507-token match is 1,504 tokens)."""

HASH_SCHEME_VERSION = 1
"""Bumped whenever the encoding or the seed changes; old and new hashes never meet."""

HASH_SEED = 0x6B76_7469_6572_0000 | HASH_SCHEME_VERSION
"""Fixed xxh3 seed: "kvtier" in its high bytes, the scheme version in the low ones.
Never derived from the process."""

BLOCK_HASH_BYTES = 16
TOKEN_DTYPE = np.dtype("<u4")
"""Canonical token encoding: little-endian uint32, whatever the host byte order."""

_UINT32_MAX = 0xFFFF_FFFF
_ARRAY_OK = array.array("I").itemsize == 4 and sys.byteorder == "little"
_ROOT_DOMAIN = b"kvtier/keyroot/v%d" % HASH_SCHEME_VERSION

KEY_ROOT_FIELDS = ("tenant", "model_id", "weights_version", "kv_dtype", "rope_config_hash", "attn_impl_id")
"""The key root's fields, in digest order (changing the order changes every hash)."""


def _encode_field(name: str, value: object) -> bytes:
    if not isinstance(value, str) or not value:
        raise ValueError(f"KeyRoot.{name} must be a non-empty string, got {value!r}")
    raw = value.encode("utf-8")
    return len(raw).to_bytes(4, "little") + raw


@dataclass(frozen=True, slots=True)
class KeyRoot:
    """Everything besides the tokens that decides what prefill produces.

    tp_degree is deliberately absent: KV is stored in a TP-agnostic canonical layout
    (`kvtier.layout`) and sharded on materialization, so a TP change keeps the cache.
    `weights_version` must be an exact digest of the weights, not a mutable tag.
    Changing any field changes `digest()` and therefore every block hash: a rollout
    needs no invalidation sweep.
    """

    tenant: str
    model_id: str
    weights_version: str
    kv_dtype: str
    rope_config_hash: str
    attn_impl_id: str
    _digest: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        encoded = _ROOT_DOMAIN + b"".join(_encode_field(name, getattr(self, name)) for name in KEY_ROOT_FIELDS)
        object.__setattr__(self, "_digest", xxhash.xxh3_128_digest(encoded, seed=HASH_SEED))

    def digest(self) -> bytes:
        """16-byte canonical digest; the parent of block 0 in every chain."""
        return self._digest

    def to_wire(self) -> dict[str, str]:
        """The root as it crosses a process boundary: a JSON object of its fields."""
        return {name: getattr(self, name) for name in KEY_ROOT_FIELDS}

    @classmethod
    def from_wire(cls, raw: Any) -> "KeyRoot":
        """A root another process sent: ValueError (a pydantic ValidationError) unless
        `raw` is exactly the object `to_wire` makes, within `WireRoot`'s bounds."""
        from kvtier.identity import WireRoot  # pydantic models stay out of this compiled module

        if isinstance(raw, WireRoot):
            return raw.key_root()
        if not isinstance(raw, Mapping):
            raise ValueError("root must be an object with the key-root fields")
        return WireRoot.model_validate(raw).key_root()

    def with_tenant(self, tenant: str) -> "KeyRoot":
        """The same model's root under another tenant."""
        return KeyRoot(tenant, *(getattr(self, name) for name in KEY_ROOT_FIELDS[1:]))

    def identity(self) -> "ModelIdentity":
        """The root minus its tenant."""
        from kvtier.identity import ModelIdentity

        return ModelIdentity(**{name: getattr(self, name) for name in KEY_ROOT_FIELDS[1:]})


def _as_array(token_ids: Iterable[int]) -> np.ndarray:
    try:
        return np.asarray(token_ids if isinstance(token_ids, (list, tuple)) else list(token_ids))
    except (OverflowError, TypeError, ValueError) as exc:
        raise ValueError(f"token_ids must be ints in [0, {_UINT32_MAX}]: {exc}") from None


def as_token_array(token_ids: Iterable[int] | np.ndarray, *, allow_empty: bool = False) -> np.ndarray:
    """Validate token ids and return them as a 1-D C-contiguous uint32 array.

    Accepts a sequence of ints or a 1-D integer ndarray. Raises ValueError naming the
    problem for floats, bool arrays, nested sequences, ids outside [0, 2**32 - 1], and for an
    empty sequence unless `allow_empty`. An input that is already a contiguous uint32
    array is returned as is (no copy).
    """
    if type(token_ids) is np.ndarray and token_ids.dtype is TOKEN_DTYPE and token_ids.ndim == 1 \
            and token_ids.size and token_ids.flags.c_contiguous:
        return token_ids  # already canonical: the per-request path of the simulator and the sidecar
    if isinstance(token_ids, (str, bytes, bytearray, memoryview)):
        raise ValueError(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}")
    if isinstance(token_ids, np.ndarray):
        arr = token_ids
    elif isinstance(token_ids, list) and token_ids and _ARRAY_OK:
        try:  # ~4x faster than np.asarray for a list of Python ints
            return np.frombuffer(array.array("I", token_ids), dtype=np.uint32)
        except (OverflowError, TypeError):
            arr = _as_array(token_ids)  # slow path, for the precise message
    else:
        arr = _as_array(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        if allow_empty:
            return np.zeros(0, dtype=TOKEN_DTYPE)
        raise ValueError("token_ids must not be empty")
    if arr.dtype == TOKEN_DTYPE:
        return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > _UINT32_MAX:
        raise ValueError(f"token ids must lie in [0, {_UINT32_MAX}], got range [{lo}, {hi}]")
    return np.ascontiguousarray(arr, dtype=TOKEN_DTYPE)


def check_block_size(block_size: int) -> int:
    """Return `block_size` if it is a positive int, else raise ValueError."""
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    return int(block_size)


def chain_hashes(parent: bytes, token_bytes: bytes, block_size: int,
                 first_block: int = 0, num_blocks: int | None = None) -> list[BlockHash]:
    """Continue a hash chain from `parent` over whole blocks of canonical token bytes.

    `token_bytes` is the whole prompt in the canonical encoding; hashing starts at
    block `first_block` (whose parent must be `parent`: the root digest for block 0,
    else the hash of block first_block - 1) and covers `num_blocks` blocks (default:
    every remaining full block). Used by `block_hashes` and by the index to extend a
    chain past what is already cached without rehashing it.
    """
    step = 4 * block_size
    end_block = len(token_bytes) // step if num_blocks is None else first_block + num_blocks
    digest, seed = xxhash.xxh3_128_digest, HASH_SEED  # locals, positional seed: ~10% on this loop
    out: list[BlockHash] = []
    h = parent
    for off in range(first_block * step, end_block * step, step):
        h = digest(h + token_bytes[off:off + step], seed)
        out.append(h)  # type: ignore[arg-type]  # digests are BlockHash by construction
    return out


def block_hashes(root: KeyRoot, token_ids: Iterable[int] | np.ndarray,
                 block_size: int = DEFAULT_BLOCK_SIZE) -> list[BlockHash]:
    """Chained hashes of every FULL block of `token_ids` under `root`.

    A trailing partial block has no hash: only whole blocks are cached or named.
    """
    if not isinstance(root, KeyRoot):
        raise ValueError(f"root must be a KeyRoot, got {type(root).__name__}")
    block_size = check_block_size(block_size)
    tokens = as_token_array(token_ids)
    return chain_hashes(root.digest(), tokens.tobytes(), block_size)
