"""The affinity table's wire form as a JSON Schema (2020-12), generated from
`kvtier.affinity.AffinityTable` so routers in other languages read the same
contract the operator writes (`kvtier contract` writes it to router/schema/).

Pydantic emits the field types, bounds and defaults. The rules the model keeps in
validators are added here, each where JSON Schema can say it: the rendezvous
version as a `const`, weights > 0, non-empty names, distinct override members.
The two cross-field rules JSON Schema cannot express (hysteresis below
spillOccupancy; every override names min(homes, members) distinct members of the
table) are listed under `x-kvtier-rules` for a reader to enforce; the shared pick
vectors carry tables that break each rule, so both readers are tested on them.

The schema is the strict wire form the operator writes: camelCase keys only,
JSON numbers for numbers. The Python model reads more leniently (snake_case
names, numeric strings); a router must not rely on that.
"""
from __future__ import annotations

import json
from typing import Any

from kvtier.affinity import AffinityTable
from kvtier.rendezvous import RENDEZVOUS_VERSION

SCHEMA_FILE = "affinity-table.schema.json"
SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

# Cross-field rules, enforced by AffinityTable's model validators.
CROSS_FIELD_RULES: list[dict[str, str]] = [
    {
        "name": "hysteresisBelowSpillOccupancy",
        "rule": "hysteresis < spillOccupancy",
        "why": "a spilled tenant returns only below spillOccupancy - hysteresis, which must be reachable",
    },
    {
        "name": "overridesNameMembers",
        "rule": "every homeOverrides value lists exactly min(homes, len(members)) distinct keys of members",
        "why": "an override replaces a tenant's k homes and must name members of this table",
    },
]

_NON_EMPTY_NAME = {"type": "string", "minLength": 1}


def schema() -> dict[str, Any]:
    """The JSON Schema of `AffinityTable.to_json()` (and of what `from_json` accepts strictly)."""
    raw = AffinityTable.model_json_schema(by_alias=True, mode="validation")
    props = {name: _drop_title(node) for name, node in raw["properties"].items()}
    props["rendezvousVersion"]["const"] = RENDEZVOUS_VERSION
    props["members"]["propertyNames"] = _NON_EMPTY_NAME
    props["members"]["additionalProperties"] = {"type": "number", "exclusiveMinimum": 0}
    props["members"]["default"] = {}
    props["homeOverrides"]["propertyNames"] = _NON_EMPTY_NAME
    props["homeOverrides"]["additionalProperties"] = {
        "type": "array",
        "items": _NON_EMPTY_NAME,
        "uniqueItems": True,
    }
    props["homeOverrides"]["default"] = {}
    return {
        "$schema": SCHEMA_DIALECT,
        "$id": f"https://kvtier.io/schemas/affinity-table/v{RENDEZVOUS_VERSION}",
        "title": "kvtier affinity table",
        "description": " ".join(raw["description"].split()),
        "type": "object",
        "additionalProperties": False,
        "properties": props,
        "x-kvtier-rules": CROSS_FIELD_RULES,
    }


def render() -> str:
    """The schema file's text: stable key order, two-space indent, trailing newline."""
    return json.dumps(schema(), indent=2, ensure_ascii=False) + "\n"


def _drop_title(node: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in node.items() if k != "title"}
    if "description" in out:
        out["description"] = " ".join(out["description"].split())
    return out
