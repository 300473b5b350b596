"""scripts/mutation.sh itself, cheaply: it lists its modules, every module it would
mutate and every test it would run exists (a renamed file must not make the run
quietly measure nothing), and a module it does not know is refused. The mutation
run itself is slow and is not part of the suite (docs/MUTATION.md)."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "mutation.sh"
sys.path.insert(0, str(ROOT / "scripts"))
from mutation_filters import function_spans  # noqa: E402


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, timeout=60)


def listed() -> dict[str, tuple[str, list[str], list[str]]]:
    """module -> (source, tests, the functions measured: none for the whole module)."""
    out = run("--list")
    assert out.returncode == 0, out.stderr
    modules: dict[str, tuple[str, list[str], list[str]]] = {}
    name = ""
    for line in out.stdout.splitlines():
        if line.startswith("    tests:"):
            source, _, only = modules[name]
            modules[name] = (source, line.split("tests:", 1)[1].split(), only)
        elif line.startswith("    only:"):
            source, tests, _ = modules[name]
            modules[name] = (source, tests, line.split("only:", 1)[1].split())
        else:
            name, source = line.split()
            modules[name] = (source, [], [])
    return modules


def test_every_listed_module_and_test_exists():
    modules = listed()
    assert set(modules) == {"keys", "radix", "admission", "peer_auth", "control_auth", "rollout", "analysis",
                            "netpol", "plan"}
    for name, (source, tests, only) in modules.items():
        assert (ROOT / source).is_file(), (name, source)
        assert tests, name
        for test in tests:
            path, _, function = test.partition("::")
            assert (ROOT / path).is_file(), (name, test)
            assert not function or f"def {function}(" in (ROOT / path).read_text(), (name, test)
        functions = function_spans(ROOT / source)
        assert not [f for f in only if f not in functions], (name, only)


def test_each_listed_equivalent_names_a_line_that_is_there_and_says_why():
    """A listed equivalent whose line was edited away would quietly mark nothing; one
    without its reason is refused by the filter."""
    entries = tomllib.loads((ROOT / "scripts" / "mutation_equivalents.toml").read_text())["equivalent"]
    assert entries
    for e in entries:
        assert e["why"].strip() and e["operator"].startswith("core/"), e
        lines = [line.strip() for line in (ROOT / e["source"]).read_text().splitlines()]
        assert e["line"].strip() in lines, e
        assert e["mutant"].strip() and e["mutant"].strip() != e["line"].strip(), e


def test_help_and_an_unknown_module():
    assert run("--help").returncode == 0 and "scripts/mutation.sh [module...]" in run("--help").stdout
    refused = run("no-such-module")
    assert refused.returncode == 2 and "unknown module 'no-such-module'" in refused.stderr


def test_annotations_are_marked_only_where_nothing_evaluates_them(tmp_path):
    from mutation_filters import annotation_spans

    body = "class C:\n    x: int | None = 1\n\n    def f(self, y: int | None = 2) -> str | None:\n        return y | 1\n"
    lazy, eager, models = tmp_path / "lazy.py", tmp_path / "eager.py", tmp_path / "models.py"
    lazy.write_text("from __future__ import annotations\n" + body)
    eager.write_text(body)
    models.write_text("from __future__ import annotations\nimport pydantic\n" + body)
    spans = annotation_spans(lazy)
    assert ((3, 7), (3, 17)) in spans and ((5, 19), (5, 29)) in spans and ((5, 38), (5, 48)) in spans
    assert not any(a <= (6, 15) <= b for a, b in spans)  # `y | 1` is code, not an annotation
    assert annotation_spans(eager) == () and annotation_spans(models) == ()


def test_functions_are_named_with_their_class(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    pass\n\n\nclass C:\n    @staticmethod\n    def g():\n        pass\n")
    spans = function_spans(src)
    assert spans["f"] == ((1, 0), (2, 8)) and spans["C.g"] == ((6, 0), (8, 12)) and set(spans) == {"f", "C", "C.g"}
