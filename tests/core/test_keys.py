"""Cache keys and chained block hashes (rule: key-root, rule: chained-hashes, rule:
tokens-not-hashes)."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from kvtier.keys import (
    BLOCK_HASH_BYTES,
    HASH_SCHEME_VERSION,
    HASH_SEED,
    KeyRoot,
    as_token_array,
    block_hashes,
    chain_hashes,
)

ROOT = KeyRoot("acme", "llama-3-70b", "sha256:0123abcd", "fp16", "rope-theta-500000", "flash-attn-2")

# Computed once with scheme version 1 and pinned: a change here breaks every peer and
# every global-index entry written by an older release.
GOLDEN_ROOT_DIGEST = "171ffb99284602d0d73563dd060b45d5"
GOLDEN_HASHES_0_40 = ["62175fdb6317dc846cd7bd37719e818f", "6e39051c44fa41311b833fd4657ea20a"]


def test_golden_vector_is_stable_across_releases():
    # The vector belongs to scheme version 1 and 16-byte hashes: a change of either
    # constant must come with new golden values, never alone.
    assert HASH_SCHEME_VERSION == 1 and BLOCK_HASH_BYTES == 16
    assert ROOT.digest().hex() == GOLDEN_ROOT_DIGEST and len(ROOT.digest()) == BLOCK_HASH_BYTES
    assert [h.hex() for h in block_hashes(ROOT, list(range(40)))] == GOLDEN_HASHES_0_40


def test_the_scheme_version_is_in_the_seed_and_the_root_domain():
    # Bumping the version alone must move every hash: it is part of both inputs.
    from kvtier import keys

    assert HASH_SEED & 0xFFFF == HASH_SCHEME_VERSION
    assert HASH_SEED >> 16 == int.from_bytes(b"kvtier", "big")
    assert keys._ROOT_DOMAIN.endswith(b"/v%d" % HASH_SCHEME_VERSION)


def test_hash_is_xxh3_128_of_parent_and_little_endian_tokens():
    tokens = np.arange(16, dtype=np.uint32)
    expected0 = xxhash.xxh3_128_digest(ROOT.digest() + tokens.astype("<u4").tobytes(), seed=HASH_SEED)
    expected1 = xxhash.xxh3_128_digest(expected0 + (tokens + 16).astype("<u4").tobytes(), seed=HASH_SEED)
    assert block_hashes(ROOT, np.arange(32)) == [expected0, expected1]


def test_hashes_are_identical_in_a_process_with_another_hash_seed():
    code = (
        "from kvtier.keys import KeyRoot, block_hashes\n"
        "r = KeyRoot('acme','llama-3-70b','sha256:0123abcd','fp16','rope-theta-500000','flash-attn-2')\n"
        "print(','.join(h.hex() for h in block_hashes(r, list(range(40)))))\n"
    )
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip().split(",") == GOLDEN_HASHES_0_40


def test_only_full_blocks_are_hashed():
    assert len(block_hashes(ROOT, range(15))) == 0
    assert len(block_hashes(ROOT, range(16))) == 1
    assert len(block_hashes(ROOT, range(1507))) == 94
    assert len(block_hashes(ROOT, range(100), block_size=32)) == 3


def test_divergent_prefixes_never_share_later_blocks():
    a = np.arange(160, dtype=np.uint32)
    b = a.copy()
    b[3 * 16 + 5] = 999_999  # diverge inside block 3; blocks 4.. are token-identical
    ha, hb = block_hashes(ROOT, a), block_hashes(ROOT, b)
    assert ha[:3] == hb[:3]
    assert all(x != y for x, y in zip(ha[3:], hb[3:]))


def test_identical_block_tokens_at_different_positions_hash_differently():
    tokens = np.tile(np.arange(16, dtype=np.uint32), 4)  # the same 16 tokens four times
    assert len(set(block_hashes(ROOT, tokens))) == 4


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(KeyRoot) if not f.name.startswith("_")])
def test_changing_any_root_field_changes_every_hash(field):
    tokens = np.arange(320)
    other = dataclasses.replace(ROOT, **{field: getattr(ROOT, field) + "x"})
    before, after = block_hashes(ROOT, tokens), block_hashes(other, tokens)
    assert len(before) == 20
    assert not set(before) & set(after)


def test_key_root_has_no_tp_degree():
    assert "tp_degree" not in {f.name for f in dataclasses.fields(KeyRoot)}


def test_field_boundaries_are_unambiguous():
    a = KeyRoot("ab", "c", "w", "fp16", "r", "a")
    b = KeyRoot("a", "bc", "w", "fp16", "r", "a")
    assert a.digest() != b.digest()


def test_chain_can_be_continued_from_any_block():
    tokens = np.arange(200, dtype=np.uint32)
    full = block_hashes(ROOT, tokens)
    tail = chain_hashes(full[4], tokens.tobytes(), 16, first_block=5)
    assert tail == full[5:]


@pytest.mark.parametrize("bad", [[-1, 2], [2**32], [1.5, 2.0], [[1, 2]], np.array([True, False]), "abc",
                                 b"\x00\x01", [2**70], (x for x in [-5]), np.zeros((2, 2), dtype=np.uint32)])
def test_bad_token_ids_raise_value_error(bad):
    with pytest.raises(ValueError):
        as_token_array(bad)


def test_empty_prompt_is_rejected_unless_allowed():
    with pytest.raises(ValueError, match="empty"):
        as_token_array([])
    assert as_token_array([], allow_empty=True).size == 0


def test_token_arrays_of_any_int_dtype_are_accepted_in_range():
    assert as_token_array(np.array([0, 2**32 - 1], dtype=np.int64)).tolist() == [0, 2**32 - 1]
    assert as_token_array((1, 2, 3)).dtype == np.dtype("<u4")
    arr = np.arange(5, dtype=np.uint32)
    assert as_token_array(arr) is arr  # no copy on the hot path


@pytest.mark.parametrize("bs", [0, -16, 1.5, True, "16"])
def test_bad_block_size_raises_value_error(bs):
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(ROOT, range(32), block_size=bs)


@pytest.mark.parametrize("bad", ["", None, 3])
def test_key_root_fields_must_be_non_empty_strings(bad):
    with pytest.raises(ValueError, match="tenant"):
        KeyRoot(bad, "m", "w", "fp16", "r", "a")


def test_a_chain_continued_for_a_few_blocks_stops_after_them():
    tokens = np.arange(200, dtype=np.uint32)
    full = block_hashes(ROOT, tokens)
    assert chain_hashes(full[1], tokens.tobytes(), 16, first_block=2, num_blocks=3) == full[2:5]


def test_a_block_of_one_token_is_a_block():
    assert len(block_hashes(ROOT, [7, 8, 9], block_size=1)) == 3


def test_any_iterable_of_ints_is_accepted_and_anything_else_is_refused_with_the_reason():
    assert as_token_array(t for t in [3, 1, 2]).tolist() == [3, 1, 2]
    assert as_token_array(range(3)).tolist() == [0, 1, 2]
    for bad in (5, [[1, 2], [3]]):  # not iterable; ragged
        with pytest.raises(ValueError, match="token_ids must be ints"):
            as_token_array(bad)


def test_a_strided_view_comes_back_contiguous():
    view = np.arange(10, dtype=np.uint32)[::2]
    out = as_token_array(view)
    assert out.flags.c_contiguous and out.tolist() == [0, 2, 4, 6, 8]


def test_a_key_root_cannot_be_changed_after_its_digest_was_taken():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ROOT.tenant = "other"  # type: ignore[misc]


def test_a_zero_dimensional_uint32_array_is_refused_not_taken_for_a_prompt():
    scalar = np.array(7, dtype=np.uint32)  # contiguous, one element, but no sequence of tokens
    with pytest.raises(ValueError, match="one-dimensional"):
        as_token_array(scalar)


def test_a_root_under_another_tenant_keeps_every_other_field():
    other = ROOT.with_tenant("globex")
    assert other.to_wire() == {**ROOT.to_wire(), "tenant": "globex"}
    assert other.digest() != ROOT.digest() and ROOT.with_tenant(ROOT.tenant) == ROOT


def test_a_roots_identity_is_its_model_without_the_tenant():
    identity = ROOT.identity()
    assert identity.model_dump() == {k: v for k, v in ROOT.to_wire().items() if k != "tenant"}
    assert identity.root(ROOT.tenant) == ROOT


def test_a_root_from_the_wire_is_the_root_sent_and_anything_but_an_object_is_refused():
    from kvtier.identity import WireRoot

    assert KeyRoot.from_wire(ROOT.to_wire()) == ROOT
    assert KeyRoot.from_wire(WireRoot(**ROOT.to_wire())) == ROOT
    for bad in (list(ROOT.to_wire().items()), "acme", None):
        with pytest.raises(ValueError, match="must be an object"):
            KeyRoot.from_wire(bad)
    with pytest.raises(ValueError):
        KeyRoot.from_wire({**ROOT.to_wire(), "tp_degree": "2"})
