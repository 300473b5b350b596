"""kvtier's per-pod sidecar: the host-DRAM tier in shared memory, the engine socket,
the peer tier, the Redis global index, the HTTP control API and Prometheus metrics.

Engines import `kvtier_sidecar.client`; the process entry point is
`kvtier_sidecar.main:main` (console script `kvtier-sidecar`).
"""
