"""Which core modules are compiled, and making sure a compiled one is never stale.

The hot modules (the index, the policy, the sketch, the cache, the routing decision,
and the simulator's event and replay loops, fleet, workload and ablation tuners) are plain Python, compiled by Cython when the
package is built (`setup.py`): the same source, about 1.4x as fast, and the same
decisions (a test replays a trace both ways and compares every match). Where no
compiler was at hand they run as the Python they are.

Python imports an extension module before a same-named `.py`, and an editable
install builds the extensions beside their sources. So an edited source would go on
being shadowed by the extension built from the version before it. The build records
each source's SHA-256 (`_compiled.json`, beside the extensions); the set-up
(`scripts/setup.sh`) rebuilds every module whose source no longer matches, and the test
session runs any it finds stale from source (`run_stale_from_source`), so `import
kvtier` itself hashes nothing. `KVTIER_PURE_PYTHON=1` runs every compiled module from
source; a comma-separated list of module names runs just those.

Nothing here may import more than the standard library: `setup.py` reads
`COMPILED_MODULES` from this file before anything is installed.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from pathlib import Path

COMPILED_MODULES = (
    "kvtier.admission",
    "kvtier.blockpool",
    "kvtier.cache",
    "kvtier.eviction",
    "kvtier.keys",
    "kvtier.radix",
    "kvtier.routing",
    "kvtier.sim.caches",
    "kvtier.sim.fleet",
    "kvtier.sim.loop",
    "kvtier.sim.replay",
    "kvtier.sim.request",
    "kvtier.sim.routers",
    "kvtier.sim.tuners",
    "kvtier.sim.workload",
)
NATIVE_MODULES = ("kvtier._copy",)
"""Extension modules written in C (`kvtier/_copy.c`), optional like the others: the code
that uses one falls back to plain Python without it."""
MANIFEST = "_compiled.json"
"""Written by the build beside the package's extensions: module name -> SHA-256 of the
source each was compiled from."""
PURE_PYTHON_ENV = "KVTIER_PURE_PYTHON"

_PACKAGE_DIR = Path(__file__).resolve().parent


def source_path(module: str, package_dir: Path = _PACKAGE_DIR) -> Path:
    """The source a compiled module is built from (`kvtier.sim.caches` -> kvtier/sim/caches.py,
    `kvtier._copy` -> kvtier/_copy.c)."""
    return package_dir.joinpath(*module.split(".")[1:]).with_suffix(".c" if module in NATIVE_MODULES else ".py")


def source_digest(path: Path) -> str:
    """SHA-256 of the source and, where there is one, of the `.pxd` beside it (its types
    are part of the build: an edited `.pxd` makes the extension stale too)."""
    h = hashlib.sha256(path.read_bytes())
    pxd = path.with_suffix(".pxd")
    if pxd.is_file():
        h.update(pxd.read_bytes())
    return h.hexdigest()


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Imports the named modules from their `.py`, ahead of any extension module."""

    def __init__(self, modules: dict[str, Path]) -> None:
        self.modules = modules

    def find_spec(self, fullname, path=None, target=None):
        src = self.modules.get(fullname)
        return None if src is None else importlib.util.spec_from_file_location(fullname, src)


def _manifest(package_dir: Path) -> dict[str, str]:
    """The last build's module -> source SHA-256 (empty when nothing was compiled)."""
    try:
        return json.loads((package_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}


def stale_modules(package_dir: Path = _PACKAGE_DIR) -> list[str]:
    """Compiled modules whose source changed since they were built (none when nothing
    was compiled)."""
    stale = []
    for module, digest in _manifest(package_dir).items():
        src = source_path(module, package_dir)
        if module in COMPILED_MODULES and src.is_file() and source_digest(src) != digest:
            stale.append(module)
    return stale


def unbuilt_modules(package_dir: Path = _PACKAGE_DIR) -> list[str]:
    """Compiled modules with no extension built from their current source (all of them
    after a pure-Python build): what `scripts/setup.sh` rebuilds."""
    built = _manifest(package_dir)
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    out = []
    for module in COMPILED_MODULES + NATIVE_MODULES:
        src = source_path(module, package_dir)
        if module in NATIVE_MODULES and not src.is_file():
            continue  # a package without that source has nothing to build
        has_ext = any(src.with_suffix(sfx).is_file() for sfx in suffixes)
        if not has_ext or built.get(module) != source_digest(src):
            out.append(module)
    return out


def compiled_modules() -> list[str]:
    """The compiled modules that are loaded as extensions right now."""
    return sorted(m for m in COMPILED_MODULES
                  if m in sys.modules and not str(getattr(sys.modules[m], "__file__", "")).endswith(".py"))


def modules_from_env(value: str | None = None) -> list[str]:
    """The compiled modules `KVTIER_PURE_PYTHON` names: all for "1", a comma-separated
    list of module names, none when unset, empty or "0"."""
    value = os.environ.get(PURE_PYTHON_ENV, "") if value is None else value
    if value in ("", "0"):
        return []
    if value == "1":
        return list(COMPILED_MODULES)
    return [m for m in (x.strip() for x in value.split(",")) if m in COMPILED_MODULES]


def use_fresh_sources(modules: list[str] | None = None) -> None:
    """Run the named compiled modules (by default those `KVTIER_PURE_PYTHON` names) from
    source. Called from the package's `__init__`, before any of them is imported."""
    chosen = {m: source_path(m) for m in (modules_from_env() if modules is None else modules)}
    if not chosen:
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _SourceFinder)), None)
    if finder is None:
        sys.meta_path.insert(0, _SourceFinder(chosen))
    else:
        finder.modules.update(chosen)


def run_stale_from_source() -> list[str]:
    """For a development loop (the test session): every compiled module whose source
    changed since its build runs from source, here and in every child process (through
    `KVTIER_PURE_PYTHON`), with a warning that says how to rebuild. Returns them."""
    stale = stale_modules()
    if stale:
        warnings.warn(f"kvtier: source changed since the extension was built, running from source: "
                      f"{', '.join(stale)} (scripts/setup.sh rebuilds the extensions)", RuntimeWarning,
                      stacklevel=2)
        already = modules_from_env()
        os.environ[PURE_PYTHON_ENV] = ",".join(sorted(set(already) | set(stale)))
        use_fresh_sources(stale)
    return stale
