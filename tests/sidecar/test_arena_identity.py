"""An engine maps the sidecar's arena by its shared-memory name. A second sidecar
started with the same identity (same namespace and pod name) on the same host
replaces the segment under that name; an engine that attaches afterwards must not
read the stranger's slots as its own sidecar's blocks (rule: fault-is-a-miss)."""
import os

import numpy as np
import pytest

from kvtier_sidecar.arena import Arena, ArenaError
from kvtier_sidecar.client import Hit, Miss, SidecarClient

from .test_sidecar_process import prompt, seed_cache

BB = 8192


def test_an_engine_attaching_after_a_twin_took_the_shm_name_gets_a_miss_not_the_twins_bytes(spawn, oracle):
    a = spawn("a", "127.0.0.2", pod_name="twin")
    first = SidecarClient(a.socket)
    root, tokens = oracle.root("t"), prompt(120)
    seed_cache(first, oracle, "t", tokens)
    expected = oracle.kv(root, tokens)
    spawn("b", "127.0.0.3", pod_name="twin")  # same identity: takes the segment's name
    late = SidecarClient(a.socket)  # an engine (re)connecting to `a` now
    hit = late.lookup(root, tokens)
    if isinstance(hit, Hit):
        dst = np.zeros(len(hit.blocks) * BB, np.uint8)
        late.materialize(hit, dst)
        assert np.array_equal(dst, expected[: len(dst)]), "an engine read another sidecar's arena"
    assert isinstance(hit, Miss)
    # `a` keeps serving the engine that mapped its own segment before.
    kept = first.lookup(root, tokens)
    assert isinstance(kept, Hit) and kept.matched_tokens == 112
    dst = np.zeros(7 * BB, np.uint8)
    first.materialize(kept, dst)
    assert np.array_equal(dst, expected[: 7 * BB])
    first.release(kept)


def test_attach_refuses_a_segment_whose_tag_is_not_its_creators():
    owner = Arena.create(f"kvt-test-tag-{os.getpid()}", 4, BB)
    try:
        same = Arena.attach(owner.name, owner.size, BB, owner.tag)
        assert same.tag == owner.tag and same.array.nbytes == 4 * BB
        same.close()
        with pytest.raises(ArenaError, match="another sidecar"):
            Arena.attach(owner.name, owner.size, BB, bytes(len(owner.tag)))
    finally:
        owner.close()
