"""`kvtier crd`: write the KVCachePolicy CRD that `kvtier.crd` renders from the models.

    kvtier crd                 write crds/ and charts/kvtier/crds/kvtier.io_kvcachepolicies.yaml
    kvtier crd --stdout        print it instead
    kvtier crd --check         exit 1 if either committed file differs from the models

The chart carries its own copy (Helm installs a chart's `crds/` before its templates),
written by the same command, so neither copy is ever edited by hand.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvtier.crd import CRD_FILE, render

_REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT_DIR = _REPO / "crds"
CHART_CRD_DIR = _REPO / "charts" / "kvtier" / "crds"
DEFAULT_OUT_DIRS = (DEFAULT_OUT_DIR, CHART_CRD_DIR)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvtier crd", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, action="append",
                        help="where to write the CRD (repeatable; default: crds/ and charts/kvtier/crds/)")
    parser.add_argument("--stdout", action="store_true", help="print the CRD instead of writing it")
    parser.add_argument("--check", action="store_true", help="exit 1 if a file in an --out-dir differs from the models")
    args = parser.parse_args(argv)
    text = render()
    if args.stdout:
        sys.stdout.write(text)
        return 0
    paths = [d / CRD_FILE for d in (args.out_dir or DEFAULT_OUT_DIRS)]
    if args.check:
        stale = [p for p in paths if not p.exists() or p.read_text() != text]
        for path in stale:
            print(f"{path} is out of date with kvtier/policy.py: run `kvtier crd`", file=sys.stderr)
        for path in paths:
            if path not in stale:
                print(f"{path} is up to date")
        return 1 if stale else 0
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    return 0
