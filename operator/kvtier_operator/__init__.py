"""kvtier's control plane: a kopf operator for the KVCachePolicy resource.

Handlers (`handlers`, `webhook`) are thin: they parse with `kvtier.policy`, call the
pure planners (`sidecar_render`, `verdicts`, `injection`, `membership`, `warmup`,
`conditions`) and do the I/O (`kube`, `sidecar_client`, `publish`).
"""
