"""`kvtier contract`: write the affinity table's contract files for other-language routers.

    kvtier contract            write router/schema/affinity-table.schema.json and
                               router/testdata/pick-vectors.json
    kvtier contract --check    exit 1 if either committed file differs from the code

The schema comes from `kvtier.affinity.AffinityTable` (kvtier.affinity_schema), the
vectors from `kvtier.routing` (kvtier_app.pick_vectors); the Go package in router/
tests itself against both, so neither file is ever edited by hand.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from kvtier import affinity_schema

from kvtier_app import pick_vectors

_REPO = Path(__file__).resolve().parents[2]
ROUTER_DIR = _REPO / "router"


def contract_files(router_dir: Path = ROUTER_DIR) -> dict[Path, Callable[[], str]]:
    """Each contract file and the function that renders its text."""
    return {
        router_dir / "schema" / affinity_schema.SCHEMA_FILE: affinity_schema.render,
        router_dir / "testdata" / pick_vectors.VECTORS_FILE: pick_vectors.render,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvtier contract", description=__doc__.split("\n\n")[0])
    parser.add_argument("--router-dir", type=Path, default=ROUTER_DIR,
                        help="the Go module's directory (default: router/ of this checkout)")
    parser.add_argument("--check", action="store_true", help="exit 1 if a committed file differs from the code")
    args = parser.parse_args(argv)
    stale = []
    for path, render in contract_files(args.router_dir).items():
        text = render()
        if args.check:
            if not path.exists() or not _same(path, text):
                stale.append(path)
                print(f"{path} is out of date with the Python code: run `kvtier contract`", file=sys.stderr)
            else:
                print(f"{path} is up to date")
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    return 1 if stale else 0


def _same(path: Path, text: str) -> bool:
    """The committed file says what the code renders (the vectors' scores within
    `pick_vectors.SCORE_REL_TOL`, everything else exactly)."""
    committed = path.read_text(encoding="utf-8")
    if committed == text or path.name != pick_vectors.VECTORS_FILE:
        return committed == text
    try:
        return pick_vectors.same_vectors(json.loads(committed), json.loads(text))
    except ValueError:
        return False
