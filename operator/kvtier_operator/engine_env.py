"""What the webhook tells the serving containers of an injected pod, so an engine with
a kvtier connector finds its sidecar and the policy's identity without any config of
its own. Pure.

    KVTIER_KV_TRANSFER_CONFIG   the engine's connector config, rendered from the policy:
                                `vllm serve ... --kv-transfer-config "$KVTIER_KV_TRANSFER_CONFIG"`
    KVTIER_WEIGHTS_VERSION      the exact weights digest (the pod's weights annotation)
    POD_NAME, POD_NAMESPACE,    where the sidecar's engine socket is: the connector
    XDG_RUNTIME_DIR             derives the path from them exactly as the sidecar does

A container that already sets one of these keeps its own value.
"""
from __future__ import annotations

import json
from typing import Any

from kvtier import policy

from kvtier_operator import names

VLLM_CONNECTOR = "KvtierConnector"
VLLM_CONNECTOR_MODULE = "kvtier_vllm.connector"
# A failed load must cost a recompute of its blocks, never the request.
VLLM_LOAD_FAILURE_POLICY = "recompute"
KV_TRANSFER_CONFIG_ENV = names.KV_TRANSFER_CONFIG_ENV


def vllm_kv_transfer_config(spec: policy.KVCachePolicySpec) -> dict[str, Any]:
    """vLLM's --kv-transfer-config for KvtierConnector under this policy."""
    return {"kv_connector": VLLM_CONNECTOR, "kv_connector_module_path": VLLM_CONNECTOR_MODULE,
            "kv_role": "kv_both", "kv_load_failure_policy": VLLM_LOAD_FAILURE_POLICY,
            "kv_connector_extra_config": {"model_id": spec.model.id, "block_size": spec.block_size}}


def engine_env(spec: policy.KVCachePolicySpec) -> list[dict[str, Any]]:
    return [
        {"name": KV_TRANSFER_CONFIG_ENV,
         "value": json.dumps(vllm_kv_transfer_config(spec), separators=(",", ":"), sort_keys=True)},
        names.weights_version_env(),
        names.field_env(names.POD_NAME_ENV, names.POD_NAME_FIELD),
        names.field_env(names.POD_NAMESPACE_ENV, names.POD_NAMESPACE_FIELD),
        {"name": names.RUNTIME_DIR_ENV, "value": names.RUN_MOUNT_PATH},
    ]


def with_engine_env(container: dict[str, Any], spec: policy.KVCachePolicySpec) -> dict[str, Any]:
    """`container` (a copy the caller owns) with the engine env added where unset."""
    env = container.setdefault("env", [])
    have = {e.get("name") for e in env}
    env.extend(e for e in engine_env(spec) if e["name"] not in have)
    return container
