"""scripts/mutation.sh itself, cheaply: it lists its modules, every module it would
mutate and every test it would run exists (a renamed file must not make the run
quietly measure nothing), and a module it does not know is refused. The mutation
run itself is slow and is not part of the suite (docs/MUTATION.md)."""
from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "mutation.sh"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, timeout=60)


def listed() -> dict[str, tuple[str, list[str]]]:
    out = run("--list")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    modules = {}
    for head, tests in zip(lines[::2], lines[1::2]):
        name, source = head.split()
        modules[name] = (source, tests.split("tests:", 1)[1].split())
    return modules


def test_every_listed_module_and_test_exists():
    modules = listed()
    assert set(modules) == {"keys", "radix", "admission", "peer_auth", "control_auth", "rollout", "analysis",
                            "netpol", "plan"}
    for name, (source, tests) in modules.items():
        assert (ROOT / source).is_file(), (name, source)
        assert tests, name
        for test in tests:
            path, _, function = test.partition("::")
            assert (ROOT / path).is_file(), (name, test)
            assert not function or f"def {function}(" in (ROOT / path).read_text(), (name, test)


def test_help_and_an_unknown_module():
    assert run("--help").returncode == 0 and "scripts/mutation.sh [module...]" in run("--help").stdout
    refused = run("no-such-module")
    assert refused.returncode == 2 and "unknown module 'no-such-module'" in refused.stderr
