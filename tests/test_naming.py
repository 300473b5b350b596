"""One word, one meaning (issue #20): a name retired because it said several things
stays retired. Each guard reads the sources, the tests and the docs (or imports the
module that held the name) and fails naming where an old name came back.

    WireModel, wire_model   -> kvtier.camel_model.CamelModel (the CRD's camelCase base;
                               "wire" is the peer protocol's word)
    kvtier.policy.Admission -> AdmissionSpec (the CRD's admission section; JSON unchanged;
                               kvtier.admission.FrequencyFilter is the runtime filter)
    AdmissionPolicies       -> kvtier_operator.admission_policies.WebhookAdmissionPolicies
                               (the policies the injection webhook decides a pod from)
    kvtier_sidecar.client.Hit -> EngineHit (what the engine client's lookup returns;
                               kvtier.cache.Hit is the core's, dram.TierHit the DRAM tier's)
    kvtier_testenv.engine_front.Engine -> ReferenceEngine (the engine the test pods' HTTP
                               front serves; not the simulator's loop nor the sidecar's
                               engine socket, EngineServer)
    kvtier.admission.Admission -> FrequencyFilter (TinyLFU's frequency filter; the CRD's
                               section is AdmissionSpec)
    kvtier.sim.engine       -> kvtier.sim.loop (the simulator's event loop)
    kvtier.sim.policies     -> kvtier.sim.routers; RoutingPolicy -> Router, <X>Policy ->
                               <X>Router ("policy" is the CRD)
    kvtier.eviction.PolicyConfig -> EvictionConfig
    CamelModel.wire()       -> CamelModel.k8s_json() (the form stored in Kubernetes; the
                               key root's and the peer protocol's wire forms keep "wire")
"""
from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What ships, what drives it, what tests it, what documents it.
TEXT_DIRS = ("kvtier", "sidecar/kvtier_sidecar", "connector/kvtier_vllm", "operator/kvtier_operator",
             "apps/kvtier_app", "testenv/kvtier_testenv", "bench", "tests", "docs", "charts")
TEXT_FILES = ("README.md", "pyproject.toml")
SUFFIXES = {".py", ".pyx", ".pxd", ".md", ".toml", ".yaml", ".yml", ".tpl", ".json"}

# Words that must not appear anywhere (they meant nothing else).
RETIRED_WORDS = ("WireModel", "wire_model", "AdmissionPolicies", "sim.engine", "sim/engine.py", "sim.policies",
                 "sim/policies.py", "RoutingPolicy", "KvtierPolicy", "make_policy", "PolicyConfig")
# (module, retired name, the name now): the module holds the new name, not the old.
RENAMED = [
    ("kvtier.camel_model", "WireModel", "CamelModel"),
    ("kvtier.policy", "Admission", "AdmissionSpec"),
    ("kvtier_operator.admission_policies", "AdmissionPolicies", "WebhookAdmissionPolicies"),
    ("kvtier_sidecar.client", "Hit", "EngineHit"),
    ("kvtier_testenv.engine_front", "Engine", "ReferenceEngine"),
    ("kvtier.admission", "Admission", "FrequencyFilter"),
    ("kvtier.sim.routers", "RoutingPolicy", "Router"),
    ("kvtier.eviction", "PolicyConfig", "EvictionConfig"),
]


def _texts() -> Iterator[tuple[str, str]]:
    me = Path(__file__).resolve()
    paths = [ROOT / f for f in TEXT_FILES]
    for top in TEXT_DIRS:
        paths.extend(p for p in sorted((ROOT / top).rglob("*")) if p.suffix in SUFFIXES and p.is_file())
    for path in paths:
        if path.resolve() != me and "__pycache__" not in path.parts:
            yield path.relative_to(ROOT).as_posix(), path.read_text(errors="replace")


def _mentions(pattern: re.Pattern[str]) -> list[str]:
    return [f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
            for rel, text in _texts() for m in pattern.finditer(text)]


@pytest.mark.parametrize("word", RETIRED_WORDS)
def test_a_retired_word_is_not_spelled_anywhere(word):
    assert _mentions(re.compile(rf"\b{re.escape(word)}\b")) == []


@pytest.mark.parametrize("module, old, new", RENAMED)
def test_a_renamed_class_answers_to_its_new_name_only(module, old, new):
    held = importlib.import_module(module)
    assert isinstance(getattr(held, new, None), type), f"{module}.{new} is gone"
    assert not hasattr(held, old), f"{module}.{old} is back: the class is {new}"


@pytest.mark.parametrize("module, old, new", RENAMED)
def test_nothing_imports_or_names_a_renamed_class_by_its_old_name(module, old, new):
    leaf = module.rsplit(".", 1)[-1]
    spelled = re.compile(rf"\b{re.escape(leaf)}\.{re.escape(old)}\b")
    found = _mentions(spelled)
    for rel, text in _texts():
        if rel.endswith(".py"):
            for node in ast.walk(ast.parse(text, filename=rel)):
                if isinstance(node, ast.ImportFrom) and node.module == (leaf if node.level else module):
                    found += [f"{rel}:{node.lineno}: from {module} import {old}"
                              for alias in node.names if alias.name == old]
    assert found == [], f"use {module}.{new}"


def test_the_guard_sees_a_retired_word():
    assert _mentions(re.compile(r"\bCamelModel\b")), "the scan reads no source at all"


def test_the_camel_models_stored_form_is_k8s_json_not_wire():
    from kvtier.camel_model import CamelModel

    assert hasattr(CamelModel, "k8s_json") and not hasattr(CamelModel, "wire")
    assert _mentions(re.compile(r"\.wire\(\)")) == []

