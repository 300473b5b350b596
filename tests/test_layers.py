"""The package layers hold: `lint-imports` keeps the contracts in pyproject.toml, and
the engine client imports with nothing but the core's dependencies."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from kvtier import _compiled

ROOT = Path(__file__).resolve().parents[1]
# A process layer's libraries (extras in pyproject): an engine that installs only the
# core's dependencies has none of them, so the engine client must not need one.
PROCESS_LAYER_LIBRARIES = ("aiohttp", "redis", "prometheus_client", "kopf", "kubernetes", "matplotlib", "tqdm")


def test_lint_imports_keeps_every_layer_contract():
    lint = Path(sys.executable).parent / "lint-imports"
    out = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


_BLOCKED_IMPORT = """
import importlib.abc, sys
BLOCKED = set({blocked!r})
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is not installed in an engine's environment")
sys.meta_path.insert(0, Block())
import kvtier_sidecar.client
print(sorted(m for m in BLOCKED if m in sys.modules))
"""


def test_the_engine_client_imports_without_any_process_layer_library():
    code = _BLOCKED_IMPORT.format(blocked=PROCESS_LAYER_LIBRARIES)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _dockerfile_sources() -> list[str]:
    """What the image's build stage (`AS build`) copies (its COPY lines): all the wheel
    may use. The test-only reference-engine stages copy more; they build another image."""
    sources, stage = [], None
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("FROM "):
            stage = line.split()[-1] if " AS " in line else None
        elif stage == "build" and line.startswith("COPY ") and "--from" not in line:
            sources += line.split()[1:-1]
    assert "kvtier" in sources and not any(s.startswith("testenv") for s in sources), sources
    return sources


def test_the_wheel_ships_the_product_layers_and_no_test_environment(tmp_path):
    src, out_dir = tmp_path / "src", tmp_path / "wheels"
    src.mkdir()
    for rel in _dockerfile_sources():  # build from exactly what the image copies
        (shutil.copytree if (ROOT / rel).is_dir() else shutil.copy)(ROOT / rel, src / rel)
    # What the wheel holds does not depend on how hard the C compiler optimises: unoptimised
    # (-O0, which comes after Python's own flags), the fifteen modules compile in ~15 s
    # rather than ~80 s on two cores. The image's build uses the default flags.
    env = {**os.environ, "CFLAGS": "-O0"}
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "-w", str(out_dir), str(src)], capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    [wheel] = out_dir.glob("kvtier-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        requires = [line for line in z.read(meta).decode().splitlines() if line.startswith("Requires-Dist:")]
    assert top == {"kvtier", "kvtier_sidecar", "kvtier_operator", "kvtier_app"}  # the connector goes in engines
    for module in _compiled.COMPILED_MODULES:  # compiled, with the source it was built from beside it
        stem = module.replace(".", "/")
        assert f"{stem}.py" in names and any(n.startswith(f"{stem}.cpython-") and n.endswith(".so") for n in names)
    assert f"kvtier/{_compiled.MANIFEST}" in names
    base = [r for r in requires if "extra ==" not in r]
    assert not [r for r in base if r.split()[1].startswith(("torch", "vllm"))], base  # only in [vllm]
    assert not [r for r in base if any(lib.replace("_", "-") in r for lib in PROCESS_LAYER_LIBRARIES)], base
