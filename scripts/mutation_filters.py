"""Cosmic-ray session filters (as `cr-filter-pragma` is one), used by scripts/mutation.sh:

* annotations: marks equivalent the mutants that lie wholly inside a type annotation of
  a module with `from __future__ import annotations`, where annotations are strings
  nothing evaluates (`X | None` -> `X & None` changes no behaviour). A module that
  imports pydantic is left alone: pydantic evaluates its models' annotations.
* listed: marks equivalent the mutants listed in scripts/mutation_equivalents.toml, each
  by its source, operator, the text of its line and that line mutated: one mutant, where a
  `# pragma: no mutate` would leave out every mutant of the line (the others on it are
  often real). An edit to that line un-marks it, so it is measured again.
* scope: with `--only NAME ...` (functions, or `Class.method`), leaves out the mutants
  outside them: a module whose measured part is some of its functions.

    python scripts/mutation_filters.py SESSION.sqlite [--only NAME ...]

Each marks a mutant SKIPPED, with the output `EQUIVALENT_OUTPUT`, `LISTED_OUTPUT` or
`OUT_OF_SCOPE_OUTPUT`; scripts/mutation.sh counts the first two, with the
`# pragma: no mutate` lines, as the marked-equivalent ones, and the last not at all.
"""
from __future__ import annotations

import argparse
import ast
import sys
import tomllib
from functools import lru_cache
from pathlib import Path

from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

EQUIVALENT_OUTPUT = "equivalent: inside an annotation (from __future__ import annotations)"
LISTED_OUTPUT = "equivalent: listed in scripts/mutation_equivalents.toml"
OUT_OF_SCOPE_OUTPUT = "out of scope: outside the functions measured"
LISTED = Path(__file__).with_name("mutation_equivalents.toml")

Pos = tuple[int, int]


def _future_annotations(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations" for a in n.names)
               for n in tree.body)


def _imports_pydantic(tree: ast.Module) -> bool:
    for n in ast.walk(tree):
        if isinstance(n, ast.Import) and any(a.name.split(".")[0] == "pydantic" for a in n.names):
            return True
        if isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "pydantic":
            return True
    return False


def _span(n: ast.AST) -> tuple[Pos, Pos]:
    """As cosmic-ray counts positions: 1-based lines, 0-based columns."""
    return (n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset)  # type: ignore[attr-defined]


@lru_cache
def annotation_spans(path: Path) -> tuple[tuple[Pos, Pos], ...]:
    tree = ast.parse(path.read_text())
    if not _future_annotations(tree) or _imports_pydantic(tree):
        return ()
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.AnnAssign):
            found.append(_span(n.annotation))
        elif isinstance(n, ast.arg) and n.annotation is not None:
            found.append(_span(n.annotation))
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.returns is not None:
            found.append(_span(n.returns))
    return tuple(found)


@lru_cache
def function_spans(path: Path) -> dict[str, tuple[Pos, Pos]]:
    """Qualified name (`f`, `Class.method`) -> the span of its definition, decorators included."""
    out: dict[str, tuple[Pos, Pos]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                start, end = _span(child)
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                out[name] = ((first, 0), end)
                visit(child, f"{name}.")

    visit(ast.parse(path.read_text()), "")
    return out


@lru_cache
def _lines(path: Path) -> tuple[str, ...]:
    return tuple(path.read_text().splitlines())


@lru_cache
def listed() -> frozenset[tuple[str, str, str, str]]:
    """(source, operator, its line's text, the mutated line's text) of every listed
    equivalent mutant (texts stripped)."""
    entries = tomllib.loads(LISTED.read_text()).get("equivalent", []) if LISTED.is_file() else []
    for e in entries:
        if not e.get("why"):
            raise SystemExit(f"{LISTED.name}: an entry without its 'why': {e}")
    return frozenset((e["source"], e["operator"], e["line"].strip(), e["mutant"].strip()) for e in entries)


def mutated_line(path: Path, operator: str, occurrence: int, line: int) -> str:
    """The text of `line` once the mutant is applied (its start line)."""
    from cosmic_ray.mutating import mutate_code
    from cosmic_ray.plugins import get_operator

    code = mutate_code(path.read_text(), get_operator(operator)(), occurrence)
    return "" if code is None else code.splitlines()[line - 1].strip()


def is_listed(module_path: str, operator: str, occurrence: int, start: Pos) -> bool:
    path = Path(module_path)
    text = _lines(path)[start[0] - 1].strip()
    rel = path.resolve().relative_to(LISTED.parent.parent.resolve()).as_posix()
    candidates = {mutant for src, op, line, mutant in listed() if (src, op, line) == (rel, operator, text)}
    return bool(candidates) and mutated_line(path, operator, occurrence, start[0]) in candidates


def _within(spans, start: Pos, end: Pos) -> bool:
    return any(a <= tuple(start) and tuple(end) <= b for a, b in spans)


def mark(db: WorkDB, only: list[str]) -> tuple[int, int]:
    """Marks the pending mutants and the survivors of an earlier run (a killed mutant
    stays killed); returns (equivalent, out of scope)."""
    equivalent = out_of_scope = 0
    survivors = [item for item, result in db.completed_work_items if result.test_outcome is TestOutcome.SURVIVED]
    for item in [*db.pending_work_items, *survivors]:
        ms = item.mutations
        if only:
            spans = function_spans(Path(ms[0].module_path))
            missing = [name for name in only if name not in spans]
            if missing:
                raise SystemExit(f"no such function in {ms[0].module_path}: {', '.join(missing)}")
            if not all(_within([spans[n] for n in only], m.start_pos, m.end_pos) for m in ms):
                db.set_result(item.job_id, WorkResult(output=OUT_OF_SCOPE_OUTPUT, worker_outcome=WorkerOutcome.SKIPPED))
                out_of_scope += 1
                continue
        if all(_within(annotation_spans(Path(m.module_path)), m.start_pos, m.end_pos) for m in ms):
            db.set_result(item.job_id, WorkResult(output=EQUIVALENT_OUTPUT, worker_outcome=WorkerOutcome.SKIPPED))
            equivalent += 1
        elif all(is_listed(m.module_path, m.operator_name, m.occurrence, m.start_pos) for m in ms):
            db.set_result(item.job_id, WorkResult(output=LISTED_OUTPUT, worker_outcome=WorkerOutcome.SKIPPED))
            equivalent += 1
    return equivalent, out_of_scope


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("session")
    parser.add_argument("--only", nargs="*", default=[], metavar="NAME")
    args = parser.parse_args(argv)
    with use_db(args.session, WorkDB.Mode.open) as db:
        equivalent, out_of_scope = mark(db, args.only)
    print(f"marked {equivalent} mutants equivalent (annotations, listed), {out_of_scope} out of scope")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
