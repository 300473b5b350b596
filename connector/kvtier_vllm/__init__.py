"""kvtier's vLLM KV connector: vLLM's paged KV cache on kvtier's DRAM and peer tiers.

Load it into vLLM (>= 0.32, V1 engine) with

    --kv-transfer-config '{"kv_connector": "KvtierConnector",
                           "kv_connector_module_path": "kvtier_vllm.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"socket": "/run/kvtier/engine.sock",
                                                         "weights_version": "sha256:..."}}'

Modules: `config` (the extra-config model and the key root), `layouts` (vLLM's paged
tensors <-> kvtier's canonical blocks, pure), `plan` (scheduler-side bookkeeping, pure),
`lookups` (the scheduler's sidecar calls on a thread, under a budget and a circuit
breaker), `worker_calls` (the workers' sidecar calls, off the forward pass), `stats`
(connector stats), `events` (kvtier's blocks on vLLM's KV event stream), `announced`
(which announced blocks to withdraw, pure), `connector` (the vLLM glue).
Only `connector`, `events` and `stats` import vllm or torch, so the pure parts are
testable without them. See docs/VLLM.md.
"""
