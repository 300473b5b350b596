"""`kubectl kvtier`: a kubectl plugin (console script `kubectl-kvtier`) for the people
running rollouts, in the spirit of `kubectl argo rollouts`.

    kubectl kvtier status [POLICY]                      phase, version, step, hit rates, analysis
    kubectl kvtier rollout promote|abort|retry|pause|resume POLICY
    kubectl kvtier affinity show POLICY                 the affinity table routers read

Rollout controls write the annotation kvtier.io/rollout-request = "<action>/<id>" on
the policy (a fresh id each time); the operator acts on it once and records it in
status.rollout.handledRequest, so the command waits for that and prints the outcome.
It talks to the cluster through the real kubectl (found on PATH, or $KVTIER_KUBECTL),
so kubeconfig, context and credentials are kubectl's own.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

from kvtier.affinity import AffinityTable

from kvtier_operator import names

KUBECTL_ENV = "KVTIER_KUBECTL"
# How long `rollout ...` waits for the operator to take the request (it ticks every few seconds).
DEFAULT_WAIT_S = 30.0
POLL_S = 0.5
ACTIONS = ("promote", "abort", "retry", "pause", "resume")


class PluginError(RuntimeError):
    pass


class Cluster:
    def __init__(self, namespace: str | None, kubeconfig: str | None, context: str | None) -> None:
        kubectl = os.environ.get(KUBECTL_ENV) or shutil.which("kubectl")
        if not kubectl:
            raise PluginError(f"kubectl not found on PATH (or set {KUBECTL_ENV})")
        self.base = [kubectl]
        for flag, value in (("--kubeconfig", kubeconfig), ("--context", context), ("--namespace", namespace)):
            if value:
                self.base += [flag, value]

    def run(self, *args: str) -> str:
        out = subprocess.run([*self.base, *args], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise PluginError(out.stderr.strip() or f"kubectl {' '.join(args)} failed")
        return out.stdout

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "-o", "json"))


# --- rendering (pure) --------------------------------------------------------------------


def _rate(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def status_lines(policy: dict[str, Any]) -> list[str]:
    meta, status = policy["metadata"], policy.get("status") or {}
    spec = policy.get("spec") or {}
    r = status.get("rollout") or {}
    lines = [
        f"Policy:        {meta['namespace']}/{meta['name']}",
        f"Phase:         {status.get('phase', '-')}",
        f"Serving:       {status.get('version', '-')}",
        f"Spec version:  {(spec.get('model') or {}).get('weightsVersion', '-')}",
        f"Members:       {status.get('memberCount', '-')}   fleet hit rate {_rate(status.get('fleetHitRate'))}",
    ]
    if r.get("targetVersion"):
        rec = (spec.get("rollout") or {}).get("recovery") or {}
        lines += [
            f"Rollout:       {r['targetVersion']} step {r.get('step')} ({r.get('canaryPercent')}% of pods)"
            + (f", paused ({r['pausedReason']})" if r.get("pausedReason") else ""),
            f"Hit rate:      {_rate(r.get('currentHitRate'))} vs baseline {_rate(r.get('baselineHitRate'))}"
            f" (threshold {rec.get('threshold', 0.8)}, source {rec.get('source', 'sidecar')})",
        ]
        a = r.get("analysis")
        if a:
            lines.append(f"Analysis:      {a.get('successes', 0)} successful, {a.get('failures', 0)} failed, "
                         f"{a.get('inconclusives', 0)} inconclusive, {a.get('consecutiveErrors', 0)} errors in a row;"
                         f" last {a.get('lastResult')}: {a.get('message', '')}")
        for h in r.get("history") or []:
            lines.append(f"  step {h['step']:>2} {h['outcome']:<10} {_rate(h.get('hitRate'))}  {h.get('time', '')}  "
                         f"{h.get('message', '')[:160]}")
        for f in r.get("firstMinutes") or []:  # each step's new pods in their first minute of traffic
            lines.append(f"  first minute step {f['step']:>2}: hit rate {_rate(f.get('hitRate'))} vs baseline "
                         f"{_rate(f.get('baselineHitRate'))}, {f.get('warmPods', 0)} warm / {f.get('coldPods', 0)} "
                         f"cold pods, {f.get('lookups', 0)} lookups in {f.get('windowS', 0):g}s")
        for w in r.get("warmups") or []:  # warm-before-ready, per pod the rollout moved
            lines.append(f"  warm {w['pod']:<20} {w['outcome']:<15} {w.get('tokens', 0)}/{w.get('budgetTokens', 0)} "
                         f"tokens, {w.get('tenants', 0)} tenants warm, {w.get('coldTenants', 0)} cold, "
                         f"{w.get('seconds', 0)}s")
    for c in status.get("conditions") or []:
        if c["type"].startswith("Rollout") or c["type"] == "RolledBack":  # incl. RolloutRequest
            lines.append(f"Condition:     {c['type']}={c['status']} ({c['reason']}): {c.get('message', '')[:200]}")
    return lines


def affinity_lines(table: AffinityTable, tenants: list[str]) -> list[str]:
    lines = [f"Epoch:   {table.epoch}   homes per tenant: {table.homes}", "Members:"]
    lines += [f"  {m}  weight {w}" for m, w in sorted(table.members.items())]
    if table.home_overrides:
        lines.append("Overrides:")
        lines += [f"  {t}: {', '.join(h)}" for t, h in sorted(table.home_overrides.items())]
    for t in tenants:
        lines.append(f"Tenant {t}: homes {', '.join(table.homes_for(t))}")
    return lines


# --- commands ---------------------------------------------------------------------------


def cmd_status(cluster: Cluster, policy: str | None) -> int:
    items = [cluster.json("get", "kvcp", policy)] if policy else cluster.json("get", "kvcp")["items"]
    if not items:
        print("no KVCachePolicy in this namespace")
        return 0
    for i, p in enumerate(items):
        if i:
            print()
        print("\n".join(status_lines(p)))
    return 0


def cmd_rollout(cluster: Cluster, action: str, policy: str, wait_s: float) -> int:
    request = f"{action}/{time.time_ns()}"
    cluster.run("annotate", "kvcp", policy, "--overwrite", f"{names.ROLLOUT_REQUEST_ANNOTATION}={request}")
    print(f"requested {action} of {policy} ({request})")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        body = cluster.json("get", "kvcp", policy)
        status = body.get("status") or {}
        if ((status.get("rollout") or {}).get("handledRequest")) == request:
            print("\n".join(status_lines(body)))
            taken = [c for c in status.get("conditions") or [] if c["type"] == "RolloutRequest"]
            return 0 if taken and taken[0]["status"] == "True" else 1
        time.sleep(POLL_S)
    print(f"the operator has not taken the request within {wait_s:.0f}s; check it runs "
          f"(kubectl kvtier status {policy})", file=sys.stderr)
    return 2


def cmd_affinity(cluster: Cluster, policy: str, tenants: list[str]) -> int:
    cm = cluster.json("get", "configmap", names.affinity_config_map(policy))
    text = (cm.get("data") or {}).get(names.AFFINITY_KEY)
    if not text:
        raise PluginError(f"ConfigMap {names.affinity_config_map(policy)} holds no {names.AFFINITY_KEY} yet")
    print("\n".join(affinity_lines(AffinityTable.from_json(text), tenants)))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kubectl kvtier", description="kvtier rollouts and affinity, from kubectl")
    p.add_argument("-n", "--namespace")
    p.add_argument("--kubeconfig")
    p.add_argument("--context")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("status", help="where each policy and its rollout stand")
    s.add_argument("policy", nargs="?")
    r = sub.add_parser("rollout", help="control a rollout")
    r.add_argument("action", choices=ACTIONS)
    r.add_argument("policy")
    r.add_argument("--wait", type=float, default=DEFAULT_WAIT_S, metavar="SECONDS",
                   help="how long to wait for the operator to act (0: do not wait)")
    a = sub.add_parser("affinity", help="the affinity table")
    a.add_argument("what", choices=("show",))
    a.add_argument("policy")
    a.add_argument("--tenant", action="append", default=[], help="also print this tenant's homes (repeatable)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cluster = Cluster(args.namespace, args.kubeconfig, args.context)
        if args.command == "status":
            return cmd_status(cluster, args.policy)
        if args.command == "rollout":
            return cmd_rollout(cluster, args.action, args.policy, args.wait)
        return cmd_affinity(cluster, args.policy, args.tenant)
    except PluginError as exc:
        print(f"kubectl kvtier: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
