"""The committed CRD is exactly what `kvtier crd` generates from the models, and the
generated schema is structural (what the apiserver demands)."""
from __future__ import annotations

import yaml

from kvtier import crd, policy
from kvtier_app import crd_cli
from operator_cases import CRDS_DIR


def _walk(node, path="$"):
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}[{i}]")


def test_committed_crd_matches_the_models():
    committed = (CRDS_DIR / crd.CRD_FILE).read_text()
    assert committed == crd.render(), "crds/ is stale: run `kvtier crd` and commit the result"


def test_check_flag_fails_on_a_stale_file_and_passes_on_a_fresh_one(tmp_path, capsys):
    (tmp_path / crd.CRD_FILE).write_text("stale\n")
    assert crd_cli.main(["--check", "--out-dir", str(tmp_path)]) == 1
    assert crd_cli.main(["--out-dir", str(tmp_path)]) == 0
    assert crd_cli.main(["--check", "--out-dir", str(tmp_path)]) == 0
    assert "up to date" in capsys.readouterr().out


def test_schema_is_structural():
    schema = crd.openapi_schema()
    for path, node in _walk(schema):
        if not isinstance(node, dict) or path.endswith(".properties") or "x-kubernetes-validations" in path:
            continue
        for banned in ("$ref", "anyOf", "oneOf", "allOf", "title", "const", "$defs"):
            assert banned not in node, f"{path} has {banned}"
        assert node.get("additionalProperties") is not False, path
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            assert bound not in node or node[bound] is True, f"{path}.{bound} must be boolean"
        if "properties" in node or "items" in node:
            assert node.get("type") in ("object", "array"), f"{path} lacks a type"


def test_every_cel_rule_of_the_models_is_in_the_crd():
    text = crd.render()
    rules = [
        rule
        for cls in vars(policy).values()
        if isinstance(cls, type) and issubclass(cls, policy.CamelModel)
        for rule in cls.__dict__.get("CEL_RULES", ())
    ]
    assert len(rules) >= 8
    served = [v for _, n in _walk(yaml.safe_load(text)) if isinstance(n, dict)
              for v in n.get("x-kubernetes-validations", [])]
    assert sorted(r["rule"] for r in served) == sorted(r.cel for r in rules)


def test_crd_identity_columns_and_status_subresource():
    obj = crd.build_crd()
    spec = obj["spec"]
    assert obj["metadata"]["name"] == "kvcachepolicies.kvtier.io"
    assert spec["scope"] == "Namespaced" and spec["names"]["shortNames"] == ["kvcp"]
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Phase", "Version", "Step", "Canary%", "HitRate", "Members", "Age"]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    cond = status["conditions"]
    assert cond["x-kubernetes-list-type"] == "map" and cond["x-kubernetes-list-map-keys"] == ["type"]
    assert set(cond["items"]["required"]) == {"type", "status", "lastTransitionTime", "reason"}
    assert "observedGeneration" in status


def test_nested_sections_default_to_their_fully_defaulted_form():
    spec = crd.openapi_schema()["properties"]["spec"]["properties"]
    for section, model in (("tiers", policy.Tiers), ("admission", policy.AdmissionSpec),
                           ("affinity", policy.Affinity), ("rollout", policy.Rollout)):
        assert spec[section]["default"] == model().k8s_json()
    assert spec["rollout"]["default"]["recovery"]["source"] == "sidecar"
    assert spec["affinity"]["properties"]["spillOccupancy"]["default"] == 0.85
    assert spec["rollout"]["properties"]["steps"]["default"] == [10, 50, 100]
