"""Builds kvtier; everything but the compiled modules is declared in pyproject.toml.

The core's hot modules (`kvtier._compiled.COMPILED_MODULES`) are plain Python that
Cython compiles here into extension modules: the same source, with type annotations
ignored so they keep Python's semantics. `kvtier._copy` (`NATIVE_MODULES`) is a small C
module, the streaming copy `kvtier.memcopy` uses when it is built. KVTIER_NO_EXTENSIONS=1 builds a pure-Python
package. The build writes each source's SHA-256 beside the extensions, so a source
edited after an in-place build runs from source rather than from a stale extension.
"""

import json
import os
import runpy
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
_compiled = runpy.run_path(str(ROOT / "kvtier" / "_compiled.py"))  # stdlib only: nothing is installed yet
MODULES = _compiled["COMPILED_MODULES"]
NATIVE = _compiled["NATIVE_MODULES"]


class BuildExt(build_ext):
    """build_ext that also writes the manifest of the sources it compiled, and compiles
    the extensions on every core unless told otherwise (`--parallel N`): `pip wheel`
    and the image's build call it with no options, and compiling the fifteen modules
    one by one took ~100 s on two cores."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1

    def run(self):
        super().run()
        if self.inplace:  # an extension of a module no longer compiled would shadow its source
            for ext in (ROOT / "kvtier").rglob("*.so"):
                module = ".".join(ext.relative_to(ROOT).with_name(ext.name.split(".")[0]).parts)
                if module not in MODULES + NATIVE:
                    ext.unlink()
        if not self.extensions:
            return
        package_dir = Path(self.get_ext_fullpath("kvtier._")).parent
        manifest = {m: _compiled["source_digest"](_compiled["source_path"](m, ROOT / "kvtier")) for m in MODULES + NATIVE}
        package_dir.mkdir(parents=True, exist_ok=True)
        (package_dir / _compiled["MANIFEST"]).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def extensions():
    if os.environ.get("KVTIER_NO_EXTENSIONS", "") not in ("", "0"):
        return []
    from Cython.Build import cythonize
    from setuptools import Extension

    sources = [str(_compiled["source_path"](m, Path("kvtier"))) for m in MODULES]
    native = [Extension(m, [str(_compiled["source_path"](m, Path("kvtier")))], extra_compile_args=["-O2"])
              for m in NATIVE]
    return cythonize(sources, build_dir="build/cython", quiet=True, force=True,  # directives may have changed
                     compiler_directives={"language_level": 3, "annotation_typing": False}) + native


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt})
