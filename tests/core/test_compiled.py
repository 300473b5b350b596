"""The compiled core modules (setup.py, kvtier._compiled): built by the set-up, the
same decisions as their Python source, and never run stale."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvtier import _compiled

ROOT = Path(__file__).resolve().parents[2]

_DECISIONS = r"""
import hashlib, json, sys
import numpy as np
from kvtier import _compiled
from kvtier.cache import LocalCache
from kvtier.keys import KeyRoot
from kvtier.sim import replay
from kvtier.sim.trace import load_trace

out = {}
trace = load_trace(sys.argv[1])
requests = replay.prepare(trace)
for capacity in ("0.01", "3M", "0.1"):
    blocks = replay.capacity_blocks(capacity, trace)
    clock = replay._Clock()
    cache = replay.make_cache("kvtier", blocks, replay.DEFAULT_BLOCK_ELEMS, clock)
    matched = []
    for t, req in zip(trace.time_s.tolist(), requests):
        clock.now = t
        matched.append(cache.serve(req, replay.ROOT, t))
    s = cache.cache.stats()
    out[capacity] = [hashlib.sha256(np.asarray(matched, dtype=np.int64).tobytes()).hexdigest(),
                     s.evictions, s.window_blocks, s.window_target_blocks, s.main_blocks, s.admission_admits,
                     s.thrash_events]

# The sidecar's path: KV bytes stored, looked up and copied out of a real arena.
rng = np.random.default_rng(7)
cache = LocalCache(64 * 4 * 64, 4 * 64, 4, min_sightings=2, drain_budget_s=0.0)
root = KeyRoot("acme", "m", "w1", "fp16", "rope", "flash")
prompts = [rng.integers(0, 50, size=int(rng.integers(4, 40))) for _ in range(40)]
copied = hashlib.sha256()
for i in range(3000):
    p = prompts[int(rng.zipf(1.3)) % len(prompts)]
    hit = cache.lookup(root, p)
    if hit.matched_tokens:
        dst = bytearray(hit.matched_tokens // 4 * 4 * 64)
        cache.materialize(hit, dst)
        copied.update(dst)
    cache.release(hit)
    n = len(p) // 4
    cache.store(root, p, np.repeat(p[:n * 4].astype(np.uint8), 64))
    cache.flush()
out["arena"] = [copied.hexdigest(), cache.stats().evictions]

# The simulator's compiled event loop, fleet, routers and routing: a small fleet under
# two routers (integer figures: tokens matched and offered, evictions, per-replica requests).
from kvtier.sim import scenarios
rep = scenarios.compare(scenarios.design_workload(3000, n_tenants=60), scenarios.small_fleet(8, 2.0),
                        policies=("kvtier", "random"))
out["fleet"] = [[r.label, r.matched_tokens, r.prompt_tokens, r.evictions] for r in rep.results]
out["compiled"] = _compiled.compiled_modules()
print(json.dumps(out))
"""


def _decisions(pure: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != _compiled.PURE_PYTHON_ENV}
    if pure:
        env[_compiled.PURE_PYTHON_ENV] = "1"
    trace = ROOT / "bench" / "traces" / "mooncake_conversation_trace.jsonl.gz"
    out = subprocess.run([sys.executable, "-c", _DECISIONS, str(trace)], capture_output=True, text=True,
                         timeout=600, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


def test_the_set_up_compiled_every_hot_module_from_its_current_source():
    assert _compiled.unbuilt_modules() == [], "run scripts/setup.sh: it compiles them"


def test_the_compiled_modules_decide_exactly_as_their_python_source():
    compiled, pure = _decisions(pure=False), _decisions(pure=True)
    assert compiled.pop("compiled") == sorted(_compiled.COMPILED_MODULES)
    assert pure.pop("compiled") == []
    assert compiled["arena"][1] > 0  # the sidecar-like workload evicts, so eviction is compared too
    assert all(matched > 0 for _, matched, _, _ in compiled["fleet"]), compiled["fleet"]  # the fleet hits
    assert compiled == pure


def _package(tmp_path: Path, source: str) -> Path:
    pkg = tmp_path / "kvtier"
    (pkg / "sim").mkdir(parents=True)
    for module in _compiled.COMPILED_MODULES:
        _compiled.source_path(module, pkg).write_text(source)
    manifest = {m: _compiled.source_digest(_compiled.source_path(m, pkg)) for m in _compiled.COMPILED_MODULES}
    (pkg / _compiled.MANIFEST).write_text(json.dumps(manifest))
    return pkg


def test_a_source_edited_after_its_build_is_stale_and_not_built(tmp_path):
    pkg = _package(tmp_path, "X = 1\n")
    for module in _compiled.COMPILED_MODULES:  # an extension beside every source
        _compiled.source_path(module, pkg).with_suffix(".cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    assert _compiled.stale_modules(pkg) == []
    _compiled.source_path("kvtier.radix", pkg).write_text("X = 2\n")
    assert _compiled.stale_modules(pkg) == ["kvtier.radix"]
    assert "kvtier.radix" in _compiled.unbuilt_modules(pkg)


def test_a_stale_module_runs_from_source_with_a_warning_here_and_in_child_processes():
    code = ("import os, subprocess, sys, warnings\n"
            "from kvtier import _compiled\n"
            "os.environ.pop(_compiled.PURE_PYTHON_ENV, None)\n"
            "_compiled.stale_modules = lambda package_dir=None: ['kvtier.radix']\n"
            "sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _compiled._SourceFinder)]\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    assert _compiled.run_stale_from_source() == ['kvtier.radix']\n"
            "import kvtier.radix, kvtier.eviction\n"
            "child = subprocess.run([sys.executable, '-c', 'import kvtier.radix, kvtier.eviction; "
            "print(kvtier.radix.__file__, kvtier.eviction.__file__)'], capture_output=True, text=True, check=True)\n"
            "print(kvtier.radix.__file__, kvtier.eviction.__file__, child.stdout.strip(), "
            "[str(x.message) for x in w])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    radix, eviction, child_radix, child_eviction = out.stdout.split()[:4]
    for r, e in ((radix, eviction), (child_radix, child_eviction)):
        assert r.endswith("kvtier/radix.py") and not e.endswith(".py")  # only the stale one
    assert "source changed since the extension was built, running from source: kvtier.radix (" in out.stdout


def test_pure_python_names_all_or_some_compiled_modules():
    assert _compiled.modules_from_env("1") == list(_compiled.COMPILED_MODULES)
    assert _compiled.modules_from_env("0") == _compiled.modules_from_env("") == []
    assert _compiled.modules_from_env("kvtier.radix, kvtier.nope,kvtier.cache") == ["kvtier.radix", "kvtier.cache"]


def test_importing_kvtier_hashes_no_source():
    code = ("import hashlib, sys\n"
            "calls = []\n"
            "real = hashlib.sha256\n"
            "hashlib.sha256 = lambda *a, **k: calls.append(1) or real(*a, **k)\n"
            "import kvtier, kvtier.radix, kvtier.cache\n"
            "print(len(calls))\n")
    env = {k: v for k, v in os.environ.items() if k != _compiled.PURE_PYTHON_ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"
