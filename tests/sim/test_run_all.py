"""bench/run_all: runs every bench module, rewrites BENCHMARKS.md, keeps sections on --only."""
import sys
import types

import pytest

# `bench` is a top-level folder, not an installed package: pytest's `pythonpath = ["."]`
# (pyproject.toml) makes the repository root importable.
from bench import run_all
from bench.common import Result


@pytest.fixture
def fake_benches(tmp_path, monkeypatch):
    calls = []

    def module(name, results=None, boom=False):
        mod = types.ModuleType(f"bench.bench_{name}")
        mod.__doc__ = f"The {name} benchmark.\n\nMore text."

        def run(quick=False):
            calls.append((name, quick))
            if boom:
                raise RuntimeError(f"{name} broke")
            return results

        mod.run = run
        monkeypatch.setitem(sys.modules, f"bench.bench_{name}", mod)

    module("alpha", [Result("speedup", 3.0, "x", 2.0, baseline=1.5, baseline_name="numpy")])
    module("beta", [Result("p99", 5.0, "ms", 1.0, "lower", "absolute")])
    module("gamma", boom=True)
    monkeypatch.setattr(run_all, "discover", lambda: ["alpha", "beta", "gamma"])
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "build.md").write_text("## Build times\n\ncold 326 s\n")
    monkeypatch.setattr(run_all, "NOTES_DIR", notes)
    return tmp_path / "BENCHMARKS.md", calls


def test_run_all_writes_every_figure_with_baseline_ratio_target_and_verdict(fake_benches):
    out, calls = fake_benches
    rc = run_all.main(["--quick", "--output", str(out)])
    text = out.read_text()
    assert rc == 1  # beta misses its target and gamma raised
    assert calls == [("alpha", True), ("beta", True), ("gamma", True)]
    assert "| speedup | 3 x | numpy = 1.5 | 2 | >= 2 (ratio) | PASS |" in text
    assert "| p99 | 5 ms | — | — | <= 1 ms | **FAIL** |" in text
    assert "**ERROR**" in text and "gamma broke" in text
    assert "x86_64" in text or "cores" in text  # the machine
    assert "`.venv/bin/python -m bench.run_all --quick`" in text
    assert "## Build times\n\ncold 326 s" in text  # notes verbatim


def test_only_reruns_one_module_and_keeps_the_others(fake_benches):
    out, calls = fake_benches
    run_all.main(["--quick", "--output", str(out)])
    before = out.read_text()
    beta_section = before[before.index("<!-- bench:beta -->"):before.index("<!-- /bench:beta -->")]
    calls.clear()
    rc = run_all.main(["--only", "alpha", "--output", str(out)])
    after = out.read_text()
    assert rc == 0 and calls == [("alpha", False)]
    assert beta_section in after
    assert "(full," in after[after.index("<!-- bench:alpha -->"):]


def test_unknown_only_name_exits_2(fake_benches, capsys):
    out, _ = fake_benches
    assert run_all.main(["--only", "nope", "--output", str(out)]) == 2
    assert "--only" in capsys.readouterr().err
    assert not out.exists()
