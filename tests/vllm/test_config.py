"""The connector's settings: what it refuses at start-up, and the key root it builds."""
from __future__ import annotations

import pytest

from kvtier_vllm.config import (
    ConfigError,
    EngineIdentity,
    check_block_sizes,
    parse_config,
    rope_config_hash,
    tenant_of,
)


def test_block_size_must_divide_vllms_and_the_message_names_both():
    check_block_sizes(32, 32)
    check_block_sizes(16, 64)
    with pytest.raises(ConfigError, match=r"kvtier block size 48 .* vLLM's block size 32"):
        check_block_sizes(48, 32)


def test_socket_and_weights_come_from_the_config_or_the_pod_environment():
    cfg = parse_config({}, env={"KVTIER_ENGINE_SOCKET": "/run/s.sock", "KVTIER_WEIGHTS_VERSION": "sha256:ab"})
    assert (cfg.socket, cfg.weights_version) == ("/run/s.sock", "sha256:ab")
    cfg = parse_config({"socket": "/x.sock", "weights_version": "sha256:cd"}, env={"KVTIER_WEIGHTS_VERSION": "no"})
    assert (cfg.socket, cfg.weights_version) == ("/x.sock", "sha256:cd")


def test_missing_weights_digest_is_refused_with_what_to_set():
    with pytest.raises(ConfigError, match="weights_version or KVTIER_WEIGHTS_VERSION"):
        parse_config({"socket": "/x.sock"}, env={})


def test_unknown_or_bad_settings_are_refused_by_name():
    with pytest.raises(ConfigError, match="blocksize"):
        parse_config({"socket": "/x", "weights_version": "w", "blocksize": 32}, env={})
    with pytest.raises(ConfigError, match="lookup_timeout_s"):
        parse_config({"socket": "/x", "weights_version": "w", "lookup_timeout_s": 0}, env={})


def test_rope_hash_follows_rope_settings_only():
    base = {"rope_theta": 10000.0, "hidden_size": 256}
    assert rope_config_hash(base) == rope_config_hash({**base, "hidden_size": 512})
    assert rope_config_hash(base) != rope_config_hash({**base, "rope_theta": 500000.0})
    assert rope_config_hash(base) != rope_config_hash({**base, "rope_scaling": {"type": "yarn", "factor": 4}})


def test_cache_salt_names_the_tenant_and_changes_the_root():
    cfg = parse_config({"socket": "/x", "weights_version": "w"}, env={})
    ident = EngineIdentity(model_id="m", weights_version="w", kv_dtype="float32", rope_config_hash="r",
                           attn_impl_id="a")
    a, b = ident.root(tenant_of("tenant-a", cfg)), ident.root(tenant_of("tenant-b", cfg))
    assert a.tenant == "tenant-a" and a.digest() != b.digest()
    assert ident.root(tenant_of(None, cfg)).tenant == "default"
    other = ident.model_copy(update={"weights_version": "w2"})
    assert other.root("tenant-a").digest() != a.digest()
