"""The checkout's demo: `./scripts/demo.sh [options]` runs `python -m kvtier_testenv.demo`.

Three modes, from the whole product down to the core library:

- `cluster` (default): a Kubernetes cluster, the operator installed by the Helm chart,
  a StatefulSet whose pods get the sidecar injected, reference engines serving traffic
  through them, a scale-up that moves tenants (warmed before the new affinity epoch is
  published) and two rollouts. By default on two real nodes (`demo_nodes`: kubelet,
  containerd, the project's images, the engines in the pods); `--nodes agent`
  (`demo_cluster`) runs the same story on the test environment's node agent, which
  starts the operator and sidecars as local processes, with the engines as clients on
  the host. `--engine vllm` (`demo_vllm`, real nodes only) serves real vLLM servers in
  the pods instead.
- `fleet`: Redis and sidecar processes on loopback with reference engines as clients
  (DRAM and peer tiers, no Kubernetes), then the local replay.
- `local`: the installed `kvtier demo` (`kvtier_app.demo`), which needs nothing of
  the checkout.
"""
from __future__ import annotations

# First: it pins BLAS to one thread before numpy loads (see there).
from kvtier_app import demo as local_demo  # isort: skip

import argparse
import json
import signal
import sys
import time
from typing import Callable


def render_fleet(report: dict, sidecars: int) -> str:
    lines = [
        f"kvtier fleet demo: Redis + {sidecars} sidecars on loopback, reference engines as clients",
        f"  requests            {report['requests']}",
        f"  hit rate            {report['hit_rate']:.1%} of requests, {report['token_hit_rate']:.1%} of prompt tokens",
    ]
    for tier, t in report["tiers"].items():
        lines.append(f"    {tier:<17} {t['hit_rate']:.1%} of requests ({t['hits']} hits), "
                     f"{t['token_hit_rate']:.1%} of tokens")
    lines += [
        f"  bytes materialized  {report['bytes_materialized']:,} (shared memory -> engine buffers)",
        f"  bytes from peers    {report['bytes_from_peers']:,} (peer tier over TCP, checksummed runs)",
        f"  stores              {report['stores']}",
        f"  wrong KV            {report['wrong_kv']} (every hit checked against a full recompute)",
        f"  request-path errors {report['errors']}",
    ]
    return "\n".join(lines)


def _main_fleet(args: argparse.Namespace) -> int:
    from kvtier_testenv.fleet import run_fleet  # the data plane: sidecars, Redis, shm

    t0 = time.perf_counter()
    report = run_fleet(sidecars=args.sidecars, requests=args.requests * 4, seed=args.seed)
    replay = None if args.json else local_demo.run_local(n_requests=args.requests, seed=args.seed)
    if args.json:
        print(json.dumps({"mode": "fleet", **report, "wall_s": time.perf_counter() - t0}, indent=2))
    else:
        print(render_fleet(report, args.sidecars))
        print()
        assert replay is not None
        print(local_demo.render(replay, local_demo.verdicts(replay)))
        print(f"\n(done in {time.perf_counter() - t0:.1f} s)")
    return 0 if report["wrong_kv"] == 0 and report["errors"] == 0 else 1


def _main_cluster(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        from kvtier_testenv import demo_vllm  # real vLLM servers as the serving pods

        return demo_vllm.main(args)
    from kvtier_testenv import demo_cluster  # the embedded Kubernetes, helm chart and operator

    return demo_cluster.main(args)


MODES: dict[str, Callable[[argparse.Namespace], int]] = {
    "cluster": _main_cluster, "fleet": _main_fleet, "local": local_demo.main_local}


def _terminated(signum: int, _frame: object) -> None:
    """SIGTERM (a CI job cancelled, `kill`) unwinds like Ctrl-C: every mode's teardown
    runs (the cluster demo's nodes leave no pod, mount or iptables chain behind)."""
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, _terminated)
    p = argparse.ArgumentParser(prog="scripts/demo.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=sorted(MODES), default="cluster",
                   help="cluster: embedded Kubernetes, helm-installed operator, injected sidecars "
                        "(default); fleet: Redis + sidecar processes + engines on loopback, no "
                        "Kubernetes; local: the installed `kvtier demo` (reference transformer, LocalCache)")
    p.add_argument("--engine", choices=("reference", "vllm"), default="reference",
                   help="cluster mode: reference engines replay as clients (default), or the serving pods "
                        "run real vLLM servers with the kvtier connector (needs hack/vllm.sh)")
    p.add_argument("--nodes", choices=("real", "agent"), default="real",
                   help="cluster mode: two real nodes, kubelet + containerd running the project's images (default; "
                        "needs root, hack/nodes.sh and hack/image.sh, which scripts/setup.sh runs), or the test "
                        "environment's node agent (the pods' processes on the host)")
    p.add_argument("--workload", choices=("statefulset", "deployment"), default="statefulset",
                   help="cluster mode on real nodes: the serving pods as a StatefulSet (rolled by partition, "
                        "default) or a Deployment (rolled as the operator's stable/canary pair)")
    p.add_argument("--sidecars", type=local_demo.positive_int, default=3, help="fleet mode: sidecar processes")
    local_demo.add_arguments(p)
    args = p.parse_args(argv)
    if args.engine != "reference" and args.mode != "cluster":
        p.error("--engine vllm runs in --mode cluster only")
    if args.engine == "vllm" and args.nodes != "real":
        p.error("--engine vllm runs on real nodes only (its vLLM servers are the pods' engine containers)")
    if args.workload != "statefulset" and (args.mode != "cluster" or args.nodes != "real"):
        p.error("--workload deployment runs in --mode cluster on real nodes only")
    return MODES[args.mode](args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
