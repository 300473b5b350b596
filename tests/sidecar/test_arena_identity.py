"""An engine maps the sidecar's arena by its shared-memory name. A second sidecar
started with the same identity (same namespace and pod name) on the same host
refuses to start while the first lives (`identity_lock`), so it never replaces the
segment under that name; and should a segment under the name ever be a stranger's,
an engine attaching to it refuses it by its tag (rule: fault-is-a-miss)."""
import os

import numpy as np
import pytest

from kvtier_sidecar.arena import Arena, ArenaError
from kvtier_sidecar.client import EngineHit, SidecarClient

from .test_sidecar_process import prompt, seed_cache

BB = 8192


def test_a_twin_with_the_same_identity_refuses_to_start_and_engines_keep_their_sidecars_bytes(spawn, oracle):
    a = spawn("a", "127.0.0.2", pod_name="twin")
    first = SidecarClient(a.socket)
    root, tokens = oracle.root("t"), prompt(120)
    seed_cache(first, oracle, "t", tokens)
    expected = oracle.kv(root, tokens)
    with pytest.raises(RuntimeError, match="another kvtier sidecar with identity"):
        spawn("b", "127.0.0.3", pod_name="twin")  # same identity: would take the segment's name
    late = SidecarClient(a.socket)  # an engine (re)connecting to `a` now
    for client in (late, first):
        hit = client.lookup(root, tokens)
        assert isinstance(hit, EngineHit) and hit.matched_tokens == 112
        dst = np.zeros(7 * BB, np.uint8)
        client.materialize(hit, dst)
        assert np.array_equal(dst, expected[: 7 * BB])
        client.release(hit)


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
