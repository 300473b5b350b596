#!/usr/bin/env python3
"""Starts the real kvtier EPP (hack/epp.sh's binary) against a real kube-apiserver and
drives it over its real ext_proc gRPC protocol with router/epp's extproc-gateway (a
stand-in for Envoy, which cannot be had here): a tenant's request lands on its home
from an affinity table file, follows the file when it changes, and carries the
tenant as cache_salt in the body the EPP forwards.

The model-server pods are Pod objects whose status this script sets (Ready, an IP):
no kubelet, no vLLM, so no metrics source is configured (every endpoint has no
occupancy report, which kvtier's pick treats as empty).

    python3 hack/epp-smoke.py --epp BIN --gateway BIN      (stdlib + testenv only)
Exit 0 when every check held; the reason otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "testenv"))

from kvtier_testenv.controlplane import ControlPlane  # noqa: E402
from kvtier_testenv.polling import wait_for  # noqa: E402
from kvtier_testenv.ports import free_port  # noqa: E402

PODS = {"vllm-a": "127.0.0.11", "vllm-b": "127.0.0.12", "vllm-c": "127.0.0.13"}
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


def table(epoch: int, acme_home: str) -> str:
    return json.dumps({"epoch": epoch, "members": {p: 1 for p in PODS}, "homes": 1,
                       "homeOverrides": {"acme": [acme_home], "default": ["vllm-c"]}})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epp", required=True)
    ap.add_argument("--gateway", required=True)
    ap.add_argument("--gie-dir", required=True, help="the EPP module's source (go mod download -json)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvtier-epp-smoke-"))
    table_path = work / "table.json"
    table_path.write_text(table(1, "vllm-b"))
    config = work / "epp.yaml"
    config.write_text((ROOT / "router/epp/config/kvtier-epp.yaml").read_text()
                      .replace("/etc/kvtier-affinity/table.json", str(table_path)))
    with ControlPlane(controller_manager=False) as cp:
        kubectl = [str(cp.bins.kubectl), "--kubeconfig", str(cp.kubeconfig)]
        # v1.5.0's standalone mode (--endpoint-selector) cannot start: its flag check
        # forbids --pool-name with it and its datastore then refuses the empty pool
        # name. So the EPP runs as in a cluster, on an InferencePool (the module's CRDs).
        crds = Path(args.gie_dir) / "config/crd/bases"
        for crd in sorted(crds.glob("*.yaml")):
            subprocess.run(kubectl + ["apply", "--server-side", "-f", str(crd)], check=True, capture_output=True)
        wait_for("the InferencePool CRD to be served", lambda: subprocess.run(
            kubectl + ["get", "inferencepools.inference.networking.k8s.io"], capture_output=True).returncode == 0,
            timeout_s=30)
        pool = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
                "metadata": {"name": "kvtier", "namespace": "default"},
                "spec": {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": 8000}],
                         "endpointPickerRef": {"name": "kvtier-epp", "port": {"number": 9002}}}}
        subprocess.run(kubectl + ["apply", "-f", "-"], input=json.dumps(pool), text=True, check=True,
                       capture_output=True)
        for name, ip in PODS.items():
            pod = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": name, "namespace": "default", "labels": {"app": "vllm"}},
                   "spec": {"containers": [{"name": "vllm", "image": "vllm",
                                            "ports": [{"containerPort": 8000}]}]}}
            subprocess.run(kubectl + ["apply", "-f", "-"], input=json.dumps(pod), text=True, check=True,
                           capture_output=True)
            status = {"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                                 "conditions": [{"type": "Ready", "status": "True"}]}}
            subprocess.run(kubectl + ["patch", "pod", name, "--subresource=status", "--type=merge",
                                      "-p", json.dumps(status)], check=True, capture_output=True)
        grpc, health, metrics = free_port(), free_port(), free_port()
        # Standalone (no InferencePool) the EPP still names itself from its pod's env
        # (a Deployment pod's name: <deployment>-<hash>-<suffix>).
        env = {**os.environ, "KUBECONFIG": str(cp.kubeconfig), "POD_NAME": "kvtier-epp-5d8f7c9b6-x2x4q", "NAMESPACE": "default"}
        log = open(work / "epp.log", "w")
        epp = subprocess.Popen([args.epp, "--config-file", str(config), "--pool-namespace", "default", "--pool-name", "kvtier",
                                "--grpc-port", str(grpc), "--grpc-health-port", str(health),
                                "--metrics-port", str(metrics), "--enable-pprof=false"],
                               env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            errors: list[str] = []

            def ask(*headers: str) -> dict | None:
                cmd = [args.gateway, "-addr", f"127.0.0.1:{grpc}", "-body", BODY, "-timeout", "5s"]
                for h in headers:
                    cmd += ["-H", h]
                out = subprocess.run(cmd, capture_output=True, text=True)
                if epp.poll() is not None:
                    raise SystemExit(f"the EPP exited ({epp.returncode}); log: {work / 'epp.log'}")
                if out.returncode != 0:
                    if [out.stderr] != errors[-1:]:
                        errors[-1:] = [out.stderr]
                        print("gateway:", out.stderr.strip(), file=sys.stderr)
                    return None
                return json.loads(out.stdout)

            def lands(want_ip: str, *headers: str):
                def probe():
                    r = ask(*headers)
                    return r if r and r.get("endpoint") == f"{want_ip}:8000" else None
                return probe

            first = wait_for("the EPP to route tenant acme to its home vllm-b",
                             lands(PODS["vllm-b"], "x-tenant-id=acme"), timeout_s=90)
            print("acme ->", first["endpoint"], "forwarded body:", json.dumps(first.get("body")))
            if (first.get("body") or {}).get("cache_salt") != "acme":
                raise SystemExit(f"forwarded body {first.get('body')} lacks cache_salt=acme")
            for _ in range(20):
                r = ask("x-tenant-id=acme")
                if not r or r.get("endpoint") != f"{PODS['vllm-b']}:8000":
                    raise SystemExit(f"acme's request went to {r}, its home is vllm-b")
            anon = wait_for("a request without the header to go to the default tenant's home vllm-c",
                            lands(PODS["vllm-c"]), timeout_s=10)
            if "cache_salt" in (anon.get("body") or {}):
                raise SystemExit(f"an anonymous request got a cache_salt: {anon}")
            print("no tenant ->", anon["endpoint"])
            table_path.write_text(table(2, "vllm-a"))
            moved = wait_for("acme to follow the new table to vllm-a",
                             lands(PODS["vllm-a"], "x-tenant-id=acme"), timeout_s=30)
            print("acme after the table moved it ->", moved["endpoint"])
            table_path.write_text("{not a table")
            for _ in range(10):
                r = ask("x-tenant-id=acme")
                if not r or r.get("endpoint") != f"{PODS['vllm-a']}:8000":
                    raise SystemExit(f"with a torn table acme's request went to {r}, want vllm-a (last good)")
            print("torn table: acme stays on", PODS["vllm-a"])
        finally:
            epp.terminate()
            try:
                epp.wait(timeout=15)
            except subprocess.TimeoutExpired:
                epp.kill()
                epp.wait()
            log.close()
    print("OK; EPP log:", work / "epp.log")
    return 0


if __name__ == "__main__":
    sys.exit(main())
