"""The connector's settings (`kv_connector_extra_config`) and the engine's key root.

    {"socket": "/run/kvtier/engine.sock",     # the sidecar's engine socket
     "weights_version": "sha256:9f2c...",     # exact weights digest (or env KVTIER_WEIGHTS_VERSION)
     "model_id": "llama-3-8b",                # defaults to vLLM's served model name
     "block_size": 32,                        # kvtier's; must divide vLLM's --block-size
     "default_tenant": "default",             # requests without a cache_salt
     "verify_checksums": false,               # hash every loaded block against the sidecar's digest
     "lookup_budget_ms": 200,                 # a request waits at most this for its lookup
     "lookup_wait_ms": 5,                     # a scheduler step waits at most this for lookups
     "breaker_backoff_s": 5.0,                # an unresponsive sidecar is left alone this long
     "store_staging_mb": 1024,                # stores waiting for a slow sidecar, at most
     "kv_events_medium": "KVTIER",            # the medium of kvtier's vLLM KV events
     "lookup_timeout_s": 2.0}                 # the lookup thread's socket timeout

The key root is everything besides the tokens that decides what prefill produces:
the tenant (the request's `cache_salt`), the model id, the exact weights digest (from
the policy, never a path), the kv cache dtype, a hash of the HF config's rope
settings and the attention backend's id. A change in any of them names other blocks.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvtier import names
from kvtier.identity import ModelIdentity
from kvtier.sidecar_config import SidecarConfig

WEIGHTS_ENV = names.WEIGHTS_VERSION_ENV
"""The downward-API variable the webhook sets from the pod's weights annotation."""
SOCKET_ENV = names.ENGINE_SOCKET_ENV
"""Where the injected sidecar's engine socket is, when the config does not say."""
DEFAULT_TENANT = "default"
"""Tenant of a request that carries no cache_salt: one shared namespace per model."""
DEFAULT_LOOKUP_TIMEOUT_S = 2.0
"""The lookup thread's socket timeout: a sidecar silent this long is disconnected (the
request itself stopped waiting long before, at its budget)."""
DEFAULT_LOOKUP_BUDGET_MS = 200.0
"""How long a new request waits for its lookup (a peer fetch included) before it
proceeds with no external tokens: a peer hit answers in tens of ms, and a prefill the
budget would have saved costs about that much on a GPU for a few thousand tokens."""
DEFAULT_LOOKUP_WAIT_MS = 5.0
"""How long one scheduler step waits, over all its new requests, for lookups to
answer before telling vLLM "not known yet": a DRAM lookup answers in well under 1 ms,
so a healthy sidecar never costs a request a step."""
DEFAULT_BREAKER_BACKOFF_S = 5.0
"""An unresponsive sidecar is not asked for this long after the breaker trips."""
DEFAULT_STORE_STAGING_MB = 1024
"""Stores copied out of vLLM's pages and not yet in the sidecar, at most (per worker):
a healthy sidecar drains them within the step; past it a store is skipped."""
DEFAULT_KV_EVENTS_MEDIUM = "KVTIER"
"""Not vLLM's GPU or CPU: a router weighs kvtier's tier by a medium of its own."""
ROPE_KEY_MARKERS = ("rope", "rotary")
"""HF config keys that shape positional encoding (rope_theta, rope_scaling, ...)."""


class ConfigError(ValueError):
    """A setting that cannot work; raised at start-up with what to fix."""


class ConnectorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    socket: str | None = None
    weights_version: str | None = Field(None, min_length=1)
    model_id: str | None = Field(None, min_length=1)
    block_size: int | None = Field(None, ge=1)
    default_tenant: str = Field(DEFAULT_TENANT, min_length=1)
    attn_impl_id: str | None = Field(None, min_length=1)
    verify_checksums: bool = False
    lookup_timeout_s: float = Field(DEFAULT_LOOKUP_TIMEOUT_S, gt=0)
    lookup_budget_ms: float = Field(DEFAULT_LOOKUP_BUDGET_MS, gt=0)
    lookup_wait_ms: float = Field(DEFAULT_LOOKUP_WAIT_MS, ge=0)
    breaker_backoff_s: float = Field(DEFAULT_BREAKER_BACKOFF_S, gt=0)
    store_staging_mb: int = Field(DEFAULT_STORE_STAGING_MB, ge=1)
    # The `medium` of the BlockStored events kvtier adds to vLLM's KV event stream
    # (published only where `--kv-events-config` enables events).
    kv_events_medium: str = Field(DEFAULT_KV_EVENTS_MEDIUM, min_length=1, max_length=64)


def parse_config(extra: Mapping[str, Any] | None, env: Mapping[str, str] = os.environ) -> ConnectorConfig:
    """Validate `kv_connector_extra_config`; the environment fills socket and weights."""
    try:
        cfg = ConnectorConfig.model_validate(dict(extra or {}))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}"
                             for e in exc.errors(include_url=False))
        raise ConfigError(f"kv_connector_extra_config for KvtierConnector is invalid: {problems}") from None
    updates = {}
    if cfg.socket is None:
        updates["socket"] = env.get(SOCKET_ENV) or _pod_socket(env)
    if cfg.weights_version is None:
        updates["weights_version"] = env.get(WEIGHTS_ENV) or None
    cfg = cfg.model_copy(update=updates)
    if not cfg.socket:
        raise ConfigError(f"KvtierConnector needs the sidecar's engine socket: set "
                          f"kv_connector_extra_config.socket or {SOCKET_ENV} (in a pod the webhook "
                          "injected, POD_NAME and POD_NAMESPACE locate it)")
    if not cfg.weights_version:
        raise ConfigError(f"KvtierConnector needs the exact weights digest: set "
                          f"kv_connector_extra_config.weights_version or {WEIGHTS_ENV} (never a path or a tag)")
    return cfg


def _pod_socket(env: Mapping[str, str]) -> str | None:
    """In an injected pod: the socket path the sidecar derives from the same pod identity."""
    name, namespace = env.get(names.POD_NAME_ENV), env.get(names.POD_NAMESPACE_ENV)
    if not name or not namespace:
        return None
    return SidecarConfig(pod_name=name, pod_namespace=namespace).engine_socket_path(env)


def check_block_sizes(kvtier_block: int, vllm_block: int) -> None:
    if kvtier_block < 1 or vllm_block % kvtier_block:
        raise ConfigError(f"kvtier block size {kvtier_block} must equal or divide vLLM's block size "
                          f"{vllm_block} (--block-size); set kv_connector_extra_config.block_size and the "
                          f"sidecar's block_size to {vllm_block} or a divisor of it")


def rope_config_hash(hf_config: Mapping[str, Any]) -> str:
    """A short digest of the HF config's positional-encoding settings."""
    rope = {k: v for k, v in hf_config.items() if any(m in k.lower() for m in ROPE_KEY_MARKERS)}
    raw = json.dumps(rope, sort_keys=True, default=str).encode()
    return "rope-" + hashlib.sha256(raw).hexdigest()[:16]


EngineIdentity = ModelIdentity
"""The key root minus the tenant: fixed for the engine's lifetime (`connector.engine_identity`)."""


def tenant_of(cache_salt: str | None, cfg: ConnectorConfig) -> str:
    """vLLM's per-request cache_salt names the tenant (the router sets it)."""
    return cache_salt if cache_salt else cfg.default_tenant


def weights_mismatch(info: dict, engine_version: str, socket: str) -> str | None:
    """Why a sidecar (its HELLO `info`) must not be used by an engine serving
    `engine_version`; None when it may (or has not said: not connected yet)."""
    theirs = info.get("weights_version")
    if theirs is None or theirs == engine_version:
        return None
    return (f"this engine serves weights {engine_version} but its sidecar at {socket} is configured for {theirs}: "
            "serving WITHOUT kvtier (no lookups, loads or stores) until they agree; set the sidecar's "
            "model.weights_version (KVTIER_WEIGHTS_VERSION) and the connector's weights_version to the same digest")
