#!/usr/bin/env python3
"""Starts the real kvtier EPP (hack/epp.sh's binary) against a real kube-apiserver and
drives it over its real ext_proc gRPC protocol with router/epp's extproc-gateway (a
stand-in for Envoy, which cannot be had here): a tenant's request lands on its home
from an affinity table file, follows the file when it changes, and carries the
tenant as cache_salt in the body the EPP forwards. The test suite's version of this,
with more checks, is tests/router/test_epp_e2e.py; both use kvtier_testenv.epp.

The model-server pods are Pod objects whose status this script sets (Ready, an IP):
no kubelet, no vLLM, so no metrics source answers (every endpoint has no occupancy
report, which kvtier's pick treats as empty).

    .venv/bin/python hack/epp-smoke.py [--epp BIN --gateway BIN]   (default: hack/epp.sh's cache)
Exit 0 when every check held; the reason otherwise.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "testenv"))

from kvtier_testenv import epp  # noqa: E402
from kvtier_testenv.controlplane import ControlPlane  # noqa: E402
from kvtier_testenv.kubectl import Kubectl  # noqa: E402

PODS = {"vllm-a": "127.0.0.11", "vllm-b": "127.0.0.12", "vllm-c": "127.0.0.13"}


def table(epoch: int, acme_home: str) -> str:
    return json.dumps({"epoch": epoch, "members": {p: 1 for p in PODS}, "homes": 1,
                       "homeOverrides": {"acme": [acme_home], "default": ["vllm-c"]}})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epp", help="kvtier-epp (default: hack/epp.sh's cache)")
    ap.add_argument("--gateway", help="extproc-gateway (default: hack/epp.sh's cache)")
    args = ap.parse_args()
    bins = epp.find() if not (args.epp and args.gateway) else epp.EppBinaries(Path(args.epp), Path(args.gateway))
    work = Path(tempfile.mkdtemp(prefix="kvtier-epp-smoke-"))
    table_path = work / "table.json"
    table_path.write_text(table(1, "vllm-b"))
    config = work / "epp.yaml"
    config.write_text(epp.picker_config(table_path))
    with ControlPlane(controller_manager=False) as cp:
        kubectl = Kubectl(cp.kubeconfig, namespace="default")
        epp.install_pool_crds(kubectl)
        epp.apply_pool(kubectl, "kvtier", {"app": "vllm"})
        for name, ip in PODS.items():
            epp.serving_pod(kubectl, name, ip, {"app": "vllm"})
        with epp.Picker(bins, cp.kubeconfig, "default", "kvtier", config, work / "epp.log") as picker:
            def stays(ip: str, n: int, why: str) -> None:
                for _ in range(n):
                    r = picker.ask("x-tenant-id=acme")
                    if not r or r.get("endpoint") != picker.endpoint(ip):
                        raise SystemExit(f"{why}: acme's request went to {r} ({picker.last_error})")

            first = picker.wait_lands("the EPP to route tenant acme to its home vllm-b", PODS["vllm-b"],
                                      "x-tenant-id=acme", timeout_s=epp.START_TIMEOUT_S)
            print("acme ->", first["endpoint"], "forwarded body:", json.dumps(first.get("body")))
            if (first.get("body") or {}).get("cache_salt") != "acme":
                raise SystemExit(f"forwarded body {first.get('body')} lacks cache_salt=acme")
            stays(PODS["vllm-b"], 20, "its home is vllm-b")
            anon = picker.wait_lands("a request without the header to go to the default tenant's home vllm-c",
                                     PODS["vllm-c"], timeout_s=10)
            if "cache_salt" in (anon.get("body") or {}):
                raise SystemExit(f"an anonymous request got a cache_salt: {anon}")
            print("no tenant ->", anon["endpoint"])
            table_path.write_text(table(2, "vllm-a"))
            moved = picker.wait_lands("acme to follow the new table to vllm-a", PODS["vllm-a"], "x-tenant-id=acme",
                                      timeout_s=30)
            print("acme after the table moved it ->", moved["endpoint"])
            table_path.write_text("{not a table")
            stays(PODS["vllm-a"], 10, "with a torn table (last good: vllm-a)")
            print("torn table: acme stays on", PODS["vllm-a"])
    print("OK; EPP log:", work / "epp.log")
    return 0


if __name__ == "__main__":
    sys.exit(main())
