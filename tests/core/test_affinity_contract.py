"""The affinity table's contract with other-language routers: the committed JSON
Schema and pick vectors are exactly what the Python code generates, the vectors
hold against kvtier.routing, the schema's bounds are the model's, and the Go
package in router/ passes them all (`go vet` and `go test`, run here)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from kvtier import affinity_schema, rendezvous, routing
from kvtier.affinity import AffinityTable
from kvtier_app import contract_cli, pick_vectors

ROUTER = contract_cli.ROUTER_DIR
SCHEMA_PATH = ROUTER / "schema" / affinity_schema.SCHEMA_FILE
VECTORS_PATH = ROUTER / "testdata" / pick_vectors.VECTORS_FILE


@pytest.fixture(scope="module")
def vectors() -> dict:
    return json.loads(VECTORS_PATH.read_text(encoding="utf-8"))


def test_committed_schema_is_the_models():
    assert SCHEMA_PATH.read_text(encoding="utf-8") == affinity_schema.render(), (
        "router/schema is stale: run `kvtier contract` and commit the result")


def test_committed_vectors_are_what_routing_decides_now():
    committed, now = json.loads(VECTORS_PATH.read_text(encoding="utf-8")), json.loads(pick_vectors.render())
    assert pick_vectors.same_vectors(committed, now), (
        "router/testdata is stale (routing, rendezvous or the table changed): run `kvtier contract`, "
        "check the Go package still passes, and commit both")


def test_vectors_compare_scores_within_a_tolerance_and_everything_else_exactly():
    now = json.loads(pick_vectors.render())
    assert pick_vectors.same_vectors(now, json.loads(pick_vectors.render()))
    nudged = json.loads(pick_vectors.render())
    scores = next(o["scores"] for o in nudged["orders"] if o.get("scores"))
    first = scores[0]
    scores[0] = first * (1 + 1e-15)
    assert pick_vectors.same_vectors(now, nudged)  # a last-bit difference is the same vector
    scores[0] = first * (1 + 1e-6)
    assert not pick_vectors.same_vectors(now, nudged)
    scores[0] = str(first)
    assert not pick_vectors.same_vectors(now, nudged)


def test_check_flag_fails_on_stale_files_and_passes_on_fresh_ones(tmp_path, capsys):
    assert contract_cli.main(["--check", "--router-dir", str(tmp_path)]) == 1
    assert contract_cli.main(["--router-dir", str(tmp_path)]) == 0
    assert contract_cli.main(["--check", "--router-dir", str(tmp_path)]) == 0
    (tmp_path / "testdata" / pick_vectors.VECTORS_FILE).write_text("{}\n")
    assert contract_cli.main(["--check", "--router-dir", str(tmp_path)]) == 1
    assert "pick-vectors.json is out of date" in capsys.readouterr().err


def test_vectors_hold_against_rendezvous_and_routing(vectors):
    tables = {name: AffinityTable.from_json(t["json"]) for name, t in vectors["tables"].items()}
    for name, h in vectors["hashes"].items():
        assert (rendezvous.tenant_hash(name), rendezvous.member_hash(name)) == (h["tenantHash"], h["memberHash"])
    for o in vectors["orders"]:
        table = tables[o["table"]]
        assert table.order_for(o["tenant"]) == o["order"]
        assert routing.homes_for(o["tenant"], table) == o["homes"]
    for seq in vectors["sequences"]:
        state = routing.SpillState() if seq["stateful"] else None
        for i, step in enumerate(seq["steps"]):
            where = f"{seq['name']} step {i}"
            versions = step.get("versions")
            if "error" in step:
                with pytest.raises(ValueError):
                    routing.pick(step["tenant"], tables[step["table"]], step["occupancy"], state, versions)
            else:
                p = routing.pick(step["tenant"], tables[step["table"]], step["occupancy"], state, versions)
                assert {"member": p.member, "rank": p.rank, "spilled": p.spilled, "epoch": p.epoch} == step["pick"], where
            if state is not None:
                assert {"epoch": state.epoch, "movedTo": state.spilled_tenants()} == step["spillState"], where


def test_vectors_cover_the_edge_cases(vectors):
    picks = [s["pick"] for seq in vectors["sequences"] for s in seq["steps"] if "pick" in s]
    assert {p["rank"] for p in picks} >= {0, 1, 2, 3}
    assert any(p["spilled"] for p in picks) and not all(p["spilled"] for p in picks)
    assert len({p["epoch"] for p in picks}) >= 5
    assert sum("error" in s for seq in vectors["sequences"] for s in seq["steps"]) == 2
    tables = {n: AffinityTable.from_json(t["json"]) for n, t in vectors["tables"].items()}
    assert any(t.home_overrides for t in tables.values())
    assert any(set(t.members.values()) - {1.0} for t in tables.values())
    assert any(len(t.members) == 1 for t in tables.values())
    tenants = {s["tenant"] for seq in vectors["sequences"] for s in seq["steps"]}
    assert any(not t.isascii() for t in tenants)
    # One SpillState carried across an epoch change.
    assert any(len({s["table"] for s in seq["steps"]}) > 1 and seq["stateful"] for seq in vectors["sequences"])


def test_screened_vectors_cover_a_rollout(vectors):
    tables = {n: AffinityTable.from_json(t["json"]) for n, t in vectors["tables"].items()}
    screened = [s for seq in vectors["sequences"] for s in seq["steps"] if "versions" in s]
    assert len(screened) >= 10
    for s in screened:
        if "pick" not in s:
            continue
        order = tables[s["table"]].order_for(s["tenant"])
        first = next((s["versions"][m] for m in order if m in s["versions"]), None)
        # Never a member of another version than the tenant's first versioned home's.
        assert first is None or s["versions"].get(s["pick"]["member"]) == first, s
    # Some decision differs from the unscreened one (the screen did something), a
    # screened pick spilled past the homes, and one stayed home with its version all hot.
    moved = [s for s in screened if s["versions"] and routing.pick(
        s["tenant"], tables[s["table"]], s["occupancy"]).member != s["pick"]["member"]]
    assert moved
    assert any(s["pick"]["spilled"] for s in screened)
    assert {c["name"] for c in vectors["screens"]} >= {"noVersions", "midRollout", "firstUnknownFollowsNext"}
    for c in vectors["screens"]:
        assert routing.screen(c["order"], c["versions"]) == c["screened"], c["name"]


def test_screen_keeps_the_first_versioned_members_version():
    order = ["a", "b", "c", "d"]
    assert routing.screen(order, {}) == order
    assert routing.screen(order, {"a": "v1", "b": "v2", "c": "v1"}) == ["a", "c"]
    assert routing.screen(order, {"b": "v2", "c": "v1", "d": "v2"}) == ["b", "d"]  # a unknown: b's version
    assert routing.screen(order, {"zz": "v1"}) == order
    table = AffinityTable(epoch=1, members=dict.fromkeys(order, 1.0), homes=2)
    tenant_order = table.order_for("t")
    versions = {m: ("v2" if i == 1 else "v1") for i, m in enumerate(tenant_order)}
    hot_first = {**dict.fromkeys(order, 0.1), tenant_order[0]: 0.99}
    p = routing.pick("t", table, hot_first, versions=versions)
    assert (p.member, p.rank, p.spilled) == (tenant_order[2], 2, True)  # past its v2 second home
    assert routing.pick("t", table, hot_first, versions={}) == routing.pick("t", table, hot_first)


def test_every_invalid_table_is_refused_by_the_model(vectors):
    assert len(vectors["invalidTables"]) >= 20
    for bad in vectors["invalidTables"]:
        with pytest.raises(ValueError):
            AffinityTable.from_json(bad["json"])


def _bound_probes(schema: dict):
    """(json text, accepted?) at and just past every numeric bound in the schema."""
    base = {"spillOccupancy": {"hysteresis": 0}, "hysteresis": {"spillOccupancy": 1}}
    for name, prop in schema["properties"].items():
        numeric = prop.get("type") in ("integer", "number")
        node = prop if numeric else prop.get("additionalProperties", {})
        if node.get("type") not in ("integer", "number"):
            continue
        step = 1 if node["type"] == "integer" else 1e-9
        for key, sign, at_ok in (("const", 1, True), ("minimum", -1, True), ("maximum", 1, True),
                                 ("exclusiveMinimum", 1, False), ("exclusiveMaximum", -1, False)):
            if key not in node:
                continue
            for value, ok in ((node[key], at_ok), (node[key] + sign * step, not at_ok if key != "const" else False)):
                body = {**base.get(name, {}), name: value if numeric else {"m": value}}
                yield json.dumps(body), ok


def test_schema_bounds_are_the_models_bounds():
    probes = list(_bound_probes(affinity_schema.schema()))
    assert len(probes) >= 16
    for text, ok in probes:
        try:
            AffinityTable.from_json(text)
            accepted = True
        except ValueError:
            accepted = False
        assert accepted == ok, text


def test_schema_defaults_are_the_models():
    empty = json.loads(AffinityTable().to_json())
    props = affinity_schema.schema()["properties"]
    assert set(props) == set(empty)
    assert {name: p["default"] for name, p in props.items()} == empty


def _go_env() -> dict[str, str]:
    # The toolchain and module cache scripts/setup.sh filled: no download, no other Go.
    return {**os.environ, "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=readonly", "GOPROXY": "off"}


def test_go_router_package_passes_vet_and_the_shared_vectors():
    go = shutil.which("go")
    assert go, "Go is not installed: the router package (router/) needs Go >= 1.26 on PATH"
    for cmd in ([go, "vet", "./..."], [go, "test", "-count=1", "./..."]):
        out = subprocess.run(cmd, cwd=ROUTER, env=_go_env(), capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, (
            f"`{' '.join(cmd[1:])}` in router/ failed (run scripts/setup.sh if modules are missing):\n"
            + out.stdout[-6000:] + out.stderr[-3000:])
    assert "ok  \tgithub.com/kvtier/kvtier/router/affinity" in out.stdout


def test_go_router_package_is_gofmt_clean():
    gofmt = shutil.which("gofmt")
    assert gofmt, "gofmt is not installed: it comes with Go, which router/ needs on PATH"
    out = subprocess.run([gofmt, "-l", "."], cwd=ROUTER, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == "", f"not gofmt-formatted (run `gofmt -w router/`):\n{out.stdout}"
