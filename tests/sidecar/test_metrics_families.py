"""The sidecar's Prometheus families (pure rendering): names and types by Prometheus
conventions, vLLM's token-counting pair, the version label on every series, bounded
tenant labels, and the index families only where a global index is configured."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvtier_sidecar.metrics import SidecarState, TenantMetrics, render

VERSION = "sha256:" + "a" * 64


def state(**kw) -> SidecarState:
    base = dict(version=VERSION, bytes_used=1024.0, capacity_bytes=4096.0, reserved_blocks=0.0, evictions=7.0,
                admission_bar=3.0, thrashing=True, pinned_hits=0, index_up=True, index_errors={"lookup": 2},
                counters={"peer_fetches": 10.0, "peer_fetch_errors": 3.0, "peer_checksum_mismatches": 1.0,
                          "stored_blocks": 5.0})
    return SidecarState(**{**base, **kw})


def families(text: bytes) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text.decode())}


def samples(fams: dict, name: str) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for s in fams[name].samples if s.name.endswith("_total")
            or fams[name].type == "gauge"}


def test_families_are_typed_named_and_carry_the_version():
    m = TenantMetrics()
    m.lookup("acme", 64, "dram", 48, served_bytes=3 * 4096)
    m.lookup("acme", 64, None, 0)
    fams = families(render(m, 10, state()))
    assert fams["kvtier_lookups"].type == "counter" and fams["kvtier_admission_bar"].type == "gauge"
    assert samples(fams, "kvtier_lookups") == {(("tenant", "acme"), ("version", VERSION)): 2.0}
    # vLLM's pair counts tokens: 128 queried, 48 matched on the DRAM tier.
    assert samples(fams, "kvtier_prefix_cache_queries")[(("tenant", "acme"), ("version", VERSION))] == 128.0
    assert samples(fams, "kvtier_prefix_cache_hits")[(("tenant", "acme"), ("tier", "dram"), ("version", VERSION))] == 48
    assert samples(fams, "kvtier_served_bytes")[(("tenant", "acme"), ("tier", "dram"), ("version", VERSION))] == 12288
    assert samples(fams, "kvtier_evictions") == {(("version", VERSION),): 7.0}
    assert samples(fams, "kvtier_thrashing") == {(("version", VERSION),): 1.0}
    errors = samples(fams, "kvtier_peer_errors")
    assert errors[(("reason", "checksum"), ("version", VERSION))] == 1.0
    assert errors[(("reason", "transport"), ("version", VERSION))] == 2.0
    idx = samples(fams, "kvtier_index_errors")
    assert idx[(("operation", "lookup"), ("version", VERSION))] == 2 and \
        idx[(("operation", "heartbeat"), ("version", VERSION))] == 0
    assert samples(fams, "kvtier_index_up") == {(("version", VERSION),): 1.0}
    assert "kvtier_stored_blocks" in fams and "kvtier_peer_fetch_errors" not in fams
    assert all(s.labels.get("version") == VERSION for f in fams.values() for s in f.samples)


def test_no_index_families_without_a_global_index():
    fams = families(render(TenantMetrics(), 10, state(index_up=None, index_errors={})))
    assert "kvtier_index_up" not in fams and "kvtier_index_errors" not in fams


def test_tenant_labels_stay_bounded():
    m = TenantMetrics()
    for i in range(50):
        for _ in range(i + 1):
            m.lookup(f"t{i}", 16, None, 0)
    fams = families(render(m, 3, state()))
    tenants = {s.labels["tenant"] for s in fams["kvtier_lookups"].samples if s.name == "kvtier_lookups_total"}
    assert tenants == {"t49", "t48", "t47", "other"}
