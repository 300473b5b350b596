"""The KVCachePolicy CustomResourceDefinition, generated from `kvtier.policy` so the
schema and the operator's models cannot drift (`kvtier crd` writes it).

Pydantic emits JSON Schema 2020-12; Kubernetes wants a *structural* OpenAPI v3 schema.
`structural()` bridges the two: it inlines `$ref`s, drops `title` and
`additionalProperties: false` (the apiserver prunes and rejects unknown fields itself),
turns optional `anyOf [X, null]` into plain X, and rewrites numeric
`exclusiveMinimum`/`exclusiveMaximum` into OpenAPI v3.0's boolean form.
"""
from __future__ import annotations

from typing import Any

import yaml

from kvtier import policy

CRD_FILE = f"{policy.GROUP}_{policy.PLURAL}.yaml"

# kubectl get kvcp columns: what an operator of the fleet checks first — phase, version,
# rollout step and canary share, fleet hit rate, members, age.
PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Version", "type": "string", "jsonPath": ".status.version"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.rollout.step"},
    {"name": "Canary%", "type": "integer", "jsonPath": ".status.rollout.canaryPercent"},
    {"name": "HitRate", "type": "number", "jsonPath": ".status.fleetHitRate"},
    {"name": "Members", "type": "integer", "jsonPath": ".status.memberCount"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def structural(schema: dict[str, Any], defs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rewrite one pydantic JSON Schema node (recursively) into structural OpenAPI v3."""
    defs = schema.get("$defs", {}) if defs is None else defs
    node = dict(schema)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        node = {**target, **node}  # siblings (description, default) win over the target's
    if "anyOf" in node:
        branches = [b for b in node.pop("anyOf") if b.get("type") != "null"]
        if len(branches) != 1:
            raise ValueError(f"cannot express a union of {len(branches)} types structurally: {branches}")
        inner = structural(branches[0], defs)
        node = {**inner, **{k: v for k, v in node.items() if k != "default" or v is not None}}
    node.pop("title", None)
    if "description" in node:
        node["description"] = " ".join(node["description"].split())
    node.pop("$defs", None)
    if node.get("additionalProperties") is False:
        node.pop("additionalProperties")
    if node.get("default", 0) is None:
        node.pop("default")
    if "const" in node:
        node["enum"] = [node.pop("const")]
    for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(bound), (int, float)) and not isinstance(node.get(bound), bool):
            node[limit] = node.pop(bound)
            node[bound] = True
    if "properties" in node:
        node["properties"] = {k: structural(v, defs) for k, v in node["properties"].items()}
        node.setdefault("type", "object")
    if isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = structural(node["additionalProperties"], defs)
    if isinstance(node.get("items"), dict):
        node["items"] = structural(node["items"], defs)
    if node.get("format") == "date-time":
        node["type"] = "string"
    return node


def _root_schema(model: type, **extra: Any) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return {**structural(raw), **extra}


def openapi_schema() -> dict[str, Any]:
    """The version's `openAPIV3Schema`: the spec and status models, plus the envelope."""
    spec = _root_schema(policy.KVCachePolicySpec)
    status = _root_schema(policy.KVCachePolicyStatus)
    return {
        "type": "object",
        "description": "A prefix-cache tier policy for the serving pods of one model.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }


def build_crd() -> dict[str, Any]:
    """The whole CustomResourceDefinition object."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{policy.PLURAL}.{policy.GROUP}",
            "labels": {"app.kubernetes.io/part-of": "kvtier"},
        },
        "spec": {
            "group": policy.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": policy.KIND,
                "listKind": f"{policy.KIND}List",
                "plural": policy.PLURAL,
                "singular": policy.SINGULAR,
                "shortNames": list(policy.SHORT_NAMES),
                "categories": ["kvtier"],
            },
            "versions": [
                {
                    "name": policy.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }


def render() -> str:
    header = "# Generated by `kvtier crd` from kvtier/policy.py. Do not edit by hand.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=100)
