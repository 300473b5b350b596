"""Shared routing test vectors: tables, request sequences and what `kvtier.routing`
decides for them, written to router/testdata/pick-vectors.json by `kvtier contract`.

The Go router package asserts every vector, so a change to the rendezvous scoring,
the table's validation or the spill rule shows up as a stale file here and as a
failing `go test` there until both sides agree again.

Layout of the file:

    hashes        name -> tenantHash, memberHash (xxh64, seeded per domain)
    tables        name -> {json: the table's wire text, valid: true}
    invalidTables [{name, json, rule}]: texts every reader must refuse
    orders        [{table, tenant, order, scores, homes}]; scores compare within a
                  tolerance (ln differs in the last bits across libms), orders exactly
    sequences     [{name, steps: [{table, tenant, occupancy, stateful, [versions,]
                  pick | error, spillState}]}]: one SpillState carried through
                  the steps of a sequence, across tables (epochs) where named; a
                  step with `versions` (member -> weights version) is screened
    screens       [{name, order, versions, screened}]: `routing.screen` alone
"""
from __future__ import annotations

import json
import math
from typing import Any

from kvtier import rendezvous, routing
from kvtier.affinity import AffinityTable

VECTORS_FILE = "pick-vectors.json"

_PODS = [f"pod-{i}" for i in range(8)]
# Names that exercise UTF-8 hashing and byte-wise sorting (equal to code point order).
UNICODE_TENANTS = ["émile", "租户-α", "🦙-llama", "tenant with spaces", "Ωmega/ns:1", "x" * 300]
_TENANTS = ["tenant-0", "tenant-1", "tenant-2", "tenant-3", "a", *UNICODE_TENANTS]


def _tables() -> dict[str, AffinityTable]:
    uniform = AffinityTable(epoch=4, members={p: 1.0 for p in _PODS}, homes=3)
    grown = AffinityTable(epoch=5, members={p: 1.0 for p in [*_PODS, "pod-8"]}, homes=3)
    # An override that reverses the tenant's plain top 3: what bounded loads can produce.
    moved = "tenant-override"
    override = AffinityTable(epoch=6, members=uniform.members, homes=3,
                             home_overrides={moved: list(reversed(uniform.homes_for(moved)))})
    return {
        "uniform8": uniform,
        "grown9": grown,
        "override": override,
        "single": AffinityTable(epoch=1, members={"solo": 1.0}, homes=3),
        "kAboveMembers": AffinityTable(epoch=2, members={"left": 1.0, "right": 1.0}, homes=3),
        "weighted": AffinityTable(
            epoch=7, members={"w-half": 0.5, "w-one": 1.0, "w-two": 2.0, "w-four": 4.0, "w-eight": 8.0},
            homes=2, spill_occupancy=0.9, balance_factor=1.5, hysteresis=0.1,
        ),
        "unicodeMembers": AffinityTable(epoch=3, members={"pod-é": 1.0, "ポッド-1": 2.5, "pod-😀": 1.0, "Pod-Z": 0.75}),
        "tightBalance": AffinityTable(epoch=8, members={p: 1.0 for p in _PODS[:4]}, homes=2, balance_factor=1.0),
        "defaults": AffinityTable.from_json("{}"),
        "oneHome": AffinityTable(epoch=9, members={p: 3.0 for p in _PODS[:5]}, homes=1, hysteresis=0.0),
    }


def _invalid_tables() -> list[dict[str, str]]:
    """Texts the model refuses, one per rule (each asserted in Python and Go)."""
    cases = [
        ("unknownField", '{"epoch":1,"replicas":3}', "additionalProperties"),
        ("otherRendezvousVersion", '{"rendezvousVersion":2}', "rendezvousVersion const"),
        ("negativeEpoch", '{"epoch":-1}', "epoch minimum"),
        ("zeroWeight", '{"members":{"a":0}}', "weight exclusiveMinimum"),
        ("negativeWeight", '{"members":{"a":-1.5}}', "weight exclusiveMinimum"),
        ("hugeWeight", '{"members":{"a":1e400}}', "weight finite"),
        ("emptyMemberName", '{"members":{"":1}}', "members propertyNames"),
        ("zeroHomes", '{"homes":0}', "homes minimum"),
        ("tooManyHomes", '{"homes":65}', "homes maximum"),
        ("zeroSpill", '{"spillOccupancy":0}', "spillOccupancy exclusiveMinimum"),
        ("spillAboveOne", '{"spillOccupancy":1.01}', "spillOccupancy maximum"),
        ("balanceBelowOne", '{"balanceFactor":0.99}', "balanceFactor minimum"),
        ("balanceTooHigh", '{"balanceFactor":100.5}', "balanceFactor maximum"),
        ("negativeHysteresis", '{"hysteresis":-0.01}', "hysteresis minimum"),
        ("hysteresisOne", '{"hysteresis":1,"spillOccupancy":1}', "hysteresis exclusiveMaximum"),
        ("hysteresisAtSpill", '{"hysteresis":0.5,"spillOccupancy":0.5}', "hysteresisBelowSpillOccupancy"),
        ("overrideNamesStranger", '{"members":{"a":1,"b":1},"homes":1,"homeOverrides":{"t":["c"]}}',
         "overridesNameMembers"),
        ("overrideTooShort", '{"members":{"a":1,"b":1,"c":1},"homes":2,"homeOverrides":{"t":["a"]}}',
         "overridesNameMembers"),
        ("overrideRepeats", '{"members":{"a":1,"b":1},"homes":2,"homeOverrides":{"t":["a","a"]}}',
         "overridesNameMembers"),
        ("overrideEmptyTenant", '{"members":{"a":1},"homes":1,"homeOverrides":{"":["a"]}}',
         "homeOverrides propertyNames"),
        ("loneSurrogate", '{"members":{"\\ud800":1}}', "JSON syntax (half a surrogate pair)"),
        ("nullEpoch", '{"epoch":null}', "epoch type"),
        ("notAnObject", '[1,2]', "type object"),
        ("truncated", '{"epoch":1', "JSON syntax"),
    ]
    return [{"name": n, "json": text, "rule": rule} for n, text, rule in cases]


def _sequences(tables: dict[str, AffinityTable]) -> list[dict[str, Any]]:
    """Request sequences: (table, tenant, occupancy[, stateful]) per step."""
    u, w, tb = tables["uniform8"], tables["weighted"], tables["tightBalance"]
    t = "tenant-0"
    h = u.order_for(t)  # its order: h[0..2] homes, then the spill path
    cool = {m: 0.3 for m in u.members}

    def occ(base: dict[str, float], **by_rank: float) -> dict[str, float]:
        out = dict(base)
        for rank, value in by_rank.items():
            out[h[int(rank[1:])]] = value
        return out

    seqs: list[dict[str, Any]] = [
        {"name": "firstHomeWhenCool", "steps": [("uniform8", t, cool)]},
        {"name": "hotFirstHomeGoesToSecond", "steps": [("uniform8", t, occ(cool, r0=0.95))]},
        {"name": "allHomesHotSpills", "steps": [("uniform8", t, occ(cool, r0=0.95, r1=0.96, r2=0.97))]},
        {"name": "wholeFleetFullStaysHome", "steps": [("uniform8", t, {m: 0.97 for m in u.members})]},
        {"name": "noReportsAtAll", "steps": [("uniform8", t, {})]},
        {"name": "missingReportsCountAsEmpty", "steps": [
            ("uniform8", t, {h[0]: 0.95, h[3]: 0.1, h[4]: 0.1}),  # mean of three reports
            ("uniform8", t, {h[0]: 0.95, h[1]: 0.95, h[2]: 0.95}),  # mean 0.95: nobody hot
        ]},
        {"name": "stickySpillWithHysteresis", "steps": [
            ("uniform8", t, occ(cool, r0=0.95)),   # -> second home
            ("uniform8", t, occ(cool, r0=0.83)),   # not hot, not cool: stays on the second home
            ("uniform8", t, occ(cool, r0=0.83, r1=0.83)),  # the sticky member need only be not hot
            ("uniform8", t, occ(cool, r0=0.86)),   # hot again
            ("uniform8", t, occ(cool, r0=0.79)),   # cool: back home, forgotten
            ("uniform8", t, occ(cool, r0=0.83)),   # not hot: home
        ]},
        {"name": "flappingWithoutStateFollowsThreshold", "stateful": False, "steps": [
            ("uniform8", t, occ(cool, r0=v)) for v in (0.86, 0.84, 0.86, 0.84)
        ]},
        {"name": "flappingWithStateStaysAway", "steps": [
            ("uniform8", t, occ(cool, r0=v)) for v in (0.86, 0.84, 0.86, 0.84, 0.70)
        ]},
        {"name": "epochChangeForgetsSpill", "steps": [
            ("uniform8", t, occ(cool, r0=0.95)),
            ("grown9", t, {**occ(cool, r0=0.83), "pod-8": 0.3}),
            ("grown9", t, {**occ(cool, r0=0.83), "pod-8": 0.3}),
        ]},
        {"name": "stickinessRulesOutEveryone", "steps": [
            ("tightBalance", t, {m: 0.1 for m in tb.members}),
            *[("tightBalance", t, o) for o in _sticky_dead_end(tb, t)],
        ]},
        {"name": "weightedSpill", "steps": [
            ("weighted", tn, o) for tn in ("tenant-1", "租户-α")
            for o in ({m: 0.2 for m in w.members}, {**{m: 0.2 for m in w.members}, w.order_for(tn)[0]: 0.95},
                      {**{m: 0.2 for m in w.members}, **{m: 0.95 for m in w.order_for(tn)[:2]}})
        ]},
        {"name": "overrideHomes", "steps": [
            ("override", "tenant-override", {}),
            ("override", "tenant-override", dict(zip(tables["override"].homes_for("tenant-override"),
                                                     (0.99, 0.1, 0.1)))),
            ("override", "tenant-1", {}),
        ]},
        {"name": "singleMember", "steps": [("single", "🦙-llama", {"solo": 0.99}), ("single", "a", {})]},
        {"name": "fewerMembersThanHomes", "steps": [
            ("kAboveMembers", "tenant-2", {}),
            ("kAboveMembers", "tenant-2", {m: v for m, v in zip(tables["kAboveMembers"].order_for("tenant-2"),
                                                                 (0.99, 0.1))}),
        ]},
        {"name": "unicodeNames", "steps": [
            ("unicodeMembers", tn, {}) for tn in UNICODE_TENANTS
        ]},
        {"name": "oneHomeNoHysteresis", "steps": [
            ("oneHome", "tenant-3", {**{m: 0.2 for m in tables["oneHome"].members},
                                     tables["oneHome"].order_for("tenant-3")[0]: v})
            for v in (0.9, 0.84, 0.86, 0.849)
        ]},
        {"name": "errors", "steps": [("emptyTable", "tenant-0", {}), ("uniform8", "", {})]},
        *_rollout_sequences(tables),
    ]
    return seqs


def _rollout_sequences(tables: dict[str, AffinityTable]) -> list[dict[str, Any]]:
    """Screened steps: a fleet mid-rollout, each tenant kept on its first home's version."""
    u = tables["uniform8"]
    t = "tenant-0"
    h = u.order_for(t)
    cool = {m: 0.3 for m in u.members}
    # Mid-rollout: the tenant's first and third homes still old, its second home and
    # the first two members past its homes already new.
    mid = {m: "v1" for m in u.members} | {h[1]: "v2", h[3]: "v2", h[4]: "v2"}
    new_first = mid | {h[0]: "v2"}
    unknown_first = {m: v for m, v in new_first.items() if m != h[0]}
    digest = {m: "h-" + "0123456789abcdef" if v == "v2" else "v1" for m, v in mid.items()}
    other = "tenant-1"
    o = u.order_for(other)
    return [
        {"name": "rolloutKeepsTheFirstHomesVersion", "steps": [
            ("uniform8", t, cool, mid),
            ("uniform8", t, cool | {h[0]: 0.95}, mid),  # skips its new-version second home
            ("uniform8", t, cool | {h[0]: 0.95, h[2]: 0.95}, mid),  # spills past v2 members
            ("uniform8", t, cool | {h[0]: 0.95}, digest),
        ]},
        {"name": "firstHomeOnTheNewVersion", "steps": [
            ("uniform8", t, cool, new_first),
            ("uniform8", t, cool | {h[0]: 0.95}, new_first),  # its v2 second home
            ("uniform8", t, cool | {h[0]: 0.95, h[1]: 0.95}, new_first),  # v2 past the homes: spilled
            ("uniform8", other, cool, {m: "v2" for m in o[1:]} | {o[0]: "v1"}),  # alone on v1
            ("uniform8", other, cool | {o[0]: 0.99}, {m: "v2" for m in o[1:]} | {o[0]: "v1"}),
        ]},
        {"name": "unknownVersions", "steps": [
            ("uniform8", t, cool, unknown_first),  # h[0] unlabelled: follows h[1]'s v2
            ("uniform8", t, cool | {h[1]: 0.95}, unknown_first),
            ("uniform8", t, cool | {h[0]: 0.95}, {"not-a-member": "v9"}),  # nobody versioned
            ("uniform8", t, cool | {h[0]: 0.95}, {}),  # empty: unscreened
        ]},
        {"name": "stickySpillWithinAVersion", "steps": [
            ("uniform8", t, cool | {h[0]: 0.95}, mid),   # -> h[2], its next v1 home
            ("uniform8", t, cool | {h[0]: 0.83}, mid),   # not cool: stays on h[2]
            ("uniform8", t, cool | {h[0]: 0.83}, new_first),  # h[0] now v2, h[2] not: h[0], h[2] forgotten
            ("uniform8", t, cool | {h[0]: 0.95}, new_first),  # -> h[1], its next v2 home
            ("uniform8", t, cool | {h[0]: 0.79}, new_first),  # cool: back on h[0]
        ]},
        {"name": "wholeVersionHotStaysOnItsFirst", "steps": [
            ("tightBalance", t, {m: 0.1 for m in tables["tightBalance"].members}
             | dict.fromkeys(tables["tightBalance"].order_for(t)[:2], 0.99),
             dict.fromkeys(tables["tightBalance"].order_for(t)[:2], "v2")),
        ]},
    ]


def _screens(tables: dict[str, AffinityTable]) -> list[dict[str, Any]]:
    """`routing.screen` on its own: the rule every router applies before its walk."""
    order = tables["uniform8"].order_for("tenant-0")
    cases: list[tuple[str, list[str], dict[str, str]]] = [
        ("noVersions", order, {}),
        ("allOneVersion", order, dict.fromkeys(order, "v1")),
        ("midRollout", order, {m: ("v2" if i % 3 == 1 else "v1") for i, m in enumerate(order)}),
        ("firstHomeNew", order, {m: ("v2" if i % 3 == 0 else "v1") for i, m in enumerate(order)}),
        ("firstUnknownFollowsNext", order, {m: "v2" for m in order[1::2]} | {m: "v1" for m in order[2::2]}),
        ("unknownDroppedOnceKnown", order, {order[2]: "v1", order[5]: "v1"}),
        ("onlyStrangersVersioned", order, {"elsewhere": "v1"}),
        ("emptyOrder", [], {"a": "v1"}),
        ("unicode", ["pod-é", "ポッド-1", "pod-😀"], {"ポッド-1": "版本-2", "pod-😀": "版本-2", "pod-é": "版本-1"}),
    ]
    return [{"name": n, "order": o, "versions": dict(sorted(v.items())), "screened": routing.screen(o, v)}
            for n, o, v in cases]


def _sticky_dead_end(table: AffinityTable, tenant: str) -> list[dict[str, float]]:
    """Occupancies that put the tenant on rank 2, then leave every member before it
    not cool and every member from it on hot (balanceFactor 1): the walk finds none."""
    o = table.order_for(tenant)
    to_rank2 = {o[0]: 0.99, o[1]: 0.99, o[2]: 0.1, o[3]: 0.1}
    dead_end = {o[0]: 0.9, o[1]: 0.9, o[2]: 0.99, o[3]: 0.99}
    return [to_rank2, dead_end]


def build() -> dict[str, Any]:
    """Every vector, computed by kvtier.routing and kvtier.rendezvous."""
    tables = _tables()
    names = sorted({*_TENANTS, "tenant-override", *(m for tb in tables.values() for m in tb.members)})
    out: dict[str, Any] = {
        "generatedBy": "kvtier contract (apps/kvtier_app/pick_vectors.py); do not edit by hand",
        "rendezvousVersion": rendezvous.RENDEZVOUS_VERSION,
        "hashes": {n: {"tenantHash": rendezvous.tenant_hash(n), "memberHash": rendezvous.member_hash(n)}
                   for n in names},
        "tables": {name: {"json": tb.to_json()} for name, tb in tables.items()},
        "invalidTables": _invalid_tables(),
        "orders": [],
        "sequences": [],
        "screens": _screens(tables),
    }
    for name, tb in tables.items():
        for tenant in [*_TENANTS, "tenant-override"]:
            out["orders"].append(_order_vector(name, tb, tenant))
    tables["emptyTable"] = AffinityTable(epoch=10)
    out["tables"]["emptyTable"] = {"json": tables["emptyTable"].to_json()}
    for seq in _sequences(tables):
        out["sequences"].append(_run_sequence(seq, tables))
    return out


def render() -> str:
    return json.dumps(build(), indent=1, ensure_ascii=False) + "\n"



SCORE_REL_TOL = 1e-12
"""Scores are computed floats (a log per candidate): the last bit may differ between
machines' math libraries, so committed vectors match the code within this tolerance;
every other value (tenants, picks, orders, weights) must be equal."""


def same_vectors(a: Any, b: Any) -> bool:
    """Whether two vector files' contents say the same, floats within SCORE_REL_TOL."""
    if isinstance(a, float) or isinstance(b, float):
        return (isinstance(a, (int, float)) and isinstance(b, (int, float))
                and math.isclose(a, b, rel_tol=SCORE_REL_TOL, abs_tol=0.0))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_vectors(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_vectors(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b

def _order_vector(name: str, table: AffinityTable, tenant: str) -> dict[str, Any]:
    order = table.order_for(tenant)
    names = sorted(table.members)
    scores = rendezvous.score_matrix(
        rendezvous.tenant_hashes([tenant]), rendezvous.member_hashes(names),
        rendezvous.check_weights([table.members[m] for m in names]))[0]
    by_name = dict(zip(names, scores.tolist()))
    return {"table": name, "tenant": tenant, "order": order,
            "scores": [by_name[m] for m in order], "homes": table.homes_for(tenant)}


def _run_sequence(seq: dict[str, Any], tables: dict[str, AffinityTable]) -> dict[str, Any]:
    stateful = seq.get("stateful", True)
    state = routing.SpillState() if stateful else None
    steps = []
    for table_name, tenant, occupancy, *screened in seq["steps"]:
        versions = screened[0] if screened else None
        step: dict[str, Any] = {"table": table_name, "tenant": tenant, "occupancy": occupancy}
        if versions is not None:
            step["versions"] = dict(sorted(versions.items()))
        try:
            p = routing.pick(tenant, tables[table_name], occupancy, state, versions)
            step["pick"] = {"member": p.member, "rank": p.rank, "spilled": p.spilled, "epoch": p.epoch}
        except ValueError as exc:
            step["error"] = str(exc)
        if state is not None:
            step["spillState"] = {"epoch": state.epoch, "movedTo": dict(sorted(state.moved_to.items()))}
        steps.append(step)
    return {"name": seq["name"], "stateful": stateful, "steps": steps}
