"""Fleet simulator: what kvtier does to a fleet's hit rate and prefill bill.

`kvtier simulate` replays a synthetic workload (tenants, templates, RAG documents,
conversations and agent loops) through a fleet of replicas, each with a host-DRAM
prefix cache, under one routing policy at a time, and reports hit rate, prefill
load and load imbalance.

The cache on every replica is the core library's real `LocalCache` (metadata-only:
no arena, so no KV bytes move) and kvtier's routing is the real
`kvtier.routing.pick` over a real affinity table; only the competitor policies and
the plain-LRU baseline live here, because they are what kvtier is compared against.

Modules, one concern each:

- `workload`  the request stream (pure, seeded, numpy-vectorised).
- `fleet`     replicas: DRAM capacity, KV bytes per token, prefill queue and HBM
              occupancy; turns tokens into replica-seconds.
- `caches`    what a replica's cache is in the simulation: kvtier's LocalCache, a
              plain LRU, and the oracle (infinite capacity, perfect routing).
- `tuners`    the window tuners only the simulator selects (ablations), registered
              with the core on import.
- `routers`   the routing policies, each a `Router` behind one interface.
- `loop`      the event loop.
- `scenarios` steady state, join/leave, rollout, thrash, capacity sweep.
- `trace`     recorded traces (Mooncake/Dynamo JSONL): parsing, and prompts built
              from hash ids.
- `replay`    a trace through one cache (kvtier, LRU, Belady, infinite) or a fleet.
- `tracegen`  synthetic traces of other shapes, in the same format.
- `report`  terminal tables and JSON (the front-ends and plots live in `kvtier_app`).
"""

from kvtier.sim import tuners as _tuners  # noqa: E402,F401  (registers the ablation tuners)
