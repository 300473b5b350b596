"""The control API's last loose ends: a body nested thousands deep is a 400 (not a 500
with a traceback), a body that is not JSON by its Content-Type is a 415, and tenant
names outside `kvtier.tenants`' rule (NUL, "../") are refused on the control API and the
engine socket alike, so they never reach a metric label. Nothing changes; the sidecar
keeps serving."""
from __future__ import annotations

import dataclasses
import json
import urllib.parse

import pytest

from kvtier.tenants import TENANT_PATTERN, is_tenant
from kvtier_sidecar.client import SidecarClient

from .test_sidecar_process import prompt

BAD_TENANTS = ["a\x00b", "../etc", "a/../b", ".", "..", "/abs", "a b", "tab\t", "a" * 257]
GOOD_TENANTS = ["t", "acme", "org/team-1", "user@example.com", "c2FsdA==", "x..y", "a:b"]


def send(side, path: str, body: bytes, content_type: str | None = "application/json") -> tuple[int, dict]:
    status, raw = side.control.post(path, body, headers={"Content-Type": content_type} if content_type else {},
                                    timeout_s=10)
    return status, json.loads(raw)


def test_the_tenant_rule_is_one_pattern_that_refuses_nul_and_path_segments():
    import re

    assert all(is_tenant(t) and re.fullmatch(TENANT_PATTERN, t) for t in GOOD_TENANTS)
    assert not any(is_tenant(t) for t in BAD_TENANTS)


@pytest.mark.parametrize("deep", [b"[" * 5000 + b"]" * 5000, b'{"a":' * 5000 + b"1" + b"}" * 5000])
def test_json_nested_thousands_deep_is_a_400_and_changes_nothing(spawn, secret_file, deep):
    side = spawn("a", "127.0.0.2", None, secret_file)
    for path in ("/cache/warm", "/cache/invalidate"):
        status, body = send(side, path, deep)
        assert status == 400, (path, status, body)
        assert "nests too deeply" in body["error"]
    assert json.loads(side.get("/cache/jobs")[1]) == {}
    assert side.get("/healthz")[0] == 200 and side.proc.poll() is None


def test_a_body_that_is_not_json_by_its_content_type_is_a_415(spawn, secret_file):
    side = spawn("a", "127.0.0.2", None, secret_file)
    valid = json.dumps({"model_version": "v"}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        status, body = send(side, "/cache/invalidate", valid, content_type)
        assert status == 415, (content_type, status, body)
        assert "application/json" in body["error"]
    assert json.loads(side.get("/cache/jobs")[1]) == {}
    assert send(side, "/cache/invalidate", valid)[0] == 202  # the same body as JSON is taken


def test_bad_tenant_names_are_refused_on_the_control_api_and_the_engine_socket(spawn, secret_file, oracle):
    side = spawn("a", "127.0.0.2", None, secret_file)
    for tenant in BAD_TENANTS:
        status, body = send(side, "/cache/warm", json.dumps(
            {"tenant": tenant, "from_peer": "127.0.0.9:7400", "max_bytes": 1 << 20}).encode())
        assert status == 422 and "tenant" in body["error"], (tenant, status, body)
        status, text = side.get("/cache/stats?tenant=" + urllib.parse.quote(tenant, safe=""))
        assert status == 400 and "tenant" in json.loads(text)["error"], (tenant, status, text)
    assert json.loads(side.get("/cache/jobs")[1]) == {}

    engine = SidecarClient(side.socket)
    tokens = prompt(40, seed=3)
    good = oracle.root("t")
    for tenant in BAD_TENANTS:
        with pytest.raises(ValueError, match="tenant"):
            engine.lookup(dataclasses.replace(good, tenant=tenant), tokens)
        engine.release(engine.lookup(good, tokens))  # the same connection keeps serving
    metrics = side.get("/metrics")[1].decode()
    assert 'tenant="t"' in metrics
    assert not any(f'tenant="{t}"' in metrics for t in ("../etc", "a/../b", ".."))
    assert "\\x00" not in metrics and "a\x00b" not in metrics
