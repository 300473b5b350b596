"""What the operator reads from and asks of a sidecar: tenants in stats, warm-up jobs
with wall-clock timestamps and idempotency refs, the peer tier switched off, the NVMe
shadow probe, and the MLA (one latent per layer) block layout."""
import json
import time
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from kvtier import presets
from kvtier import sidecar_config as sc
from kvtier_sidecar.client import EngineHit, Miss, SidecarClient
from .test_sidecar_process import BB, poll, prompt, seed_cache


def test_whole_cache_stats_list_tenants_by_bytes_with_hits_bounded_by_config(spawn, oracle):
    side = spawn(stats_max_tenants=2)
    client = SidecarClient(side.socket)
    for tenant, n_prompts in (("big", 3), ("mid", 2), ("small", 1)):
        for s in range(n_prompts):
            seed_cache(client, oracle, tenant, prompt(100, seed=s))
    client.release(client.lookup(oracle.root("small"), prompt(100, seed=0)))
    client.lookup(oracle.root("nothing-cached"), prompt(40))
    stats = side.stats()
    assert stats["tenants_total"] == 4
    assert list(stats["tenants"]) == ["big", "mid"]  # the two holding most bytes
    for tenant, row in stats["tenants"].items():
        own = side.stats(tenant)
        assert row["bytes"] == own["cache"]["bytes_used"] > 0
        assert (row["lookups"], row["hits"]) == (own["lookups"], own["hits"])
    assert stats["tenants"]["big"]["bytes"] == 18 * BB  # 3 prompts x 6 full blocks


def test_warm_job_records_wall_clock_start_finish_bytes_and_answers_a_repeated_ref(spawn, oracle, secret_file):
    a = spawn("a", "127.0.0.2", None, secret_file)
    b = spawn("b", "127.0.0.3", None, secret_file)
    seed_cache(SidecarClient(a.socket), oracle, "moved", prompt(100, seed=1))
    before = time.time()
    body = {"tenant": "moved", "from_peer": a.peer, "max_bytes": 1 << 20, "ref": "epoch-7/moved"}
    status, first = b.post("/cache/warm", body)
    assert status == 202, first
    first = json.loads(first)
    assert first["started"] is True
    job = poll(lambda: (j := json.loads(b.get("/cache/jobs")[1])[first["job"]])["state"] == "done" and j)
    assert before <= job["started_s"] <= job["finished_s"] <= time.time()
    assert job["bytes"] == 6 * BB and job["tenant"] == "moved" and job["from_peer"] == a.peer
    assert b.stats()["tenants"]["moved"]["warmed_bytes"] == 6 * BB
    # The same ref again (an operator that restarted mid-epoch) is the same job.
    status, again = b.post("/cache/warm", body)
    assert status == 202 and json.loads(again) == {**first, "started": False}
    jobs = json.loads(b.get("/cache/jobs")[1])
    assert list(jobs) == [first["job"]] and jobs[first["job"]]["asks"] == 2


def test_peer_tier_disabled_serves_no_peer_and_refuses_warm_ups(spawn, oracle, redis_url, secret_file):
    a = spawn("a", "127.0.0.2", redis_url, secret_file)
    b = spawn("b", "127.0.0.3", redis_url, secret_file, peer_enabled=False)
    root, tokens = oracle.root("t"), prompt(100)
    seed_cache(SidecarClient(a.socket), oracle, "t", tokens)
    assert b.ready["peer"] == "" and b.stats()["peer_enabled"] is False
    assert isinstance(SidecarClient(b.socket).lookup(root, tokens), Miss)
    assert b.stats()["index"]["enabled"] is False
    status, body = b.post("/cache/warm", {"tenant": "t", "from_peer": a.peer, "max_bytes": 1 << 20})
    assert status == 409 and b"peer tier is disabled" in body


def test_nvme_shadow_measures_the_disk_without_serving_and_follows_a_reload(spawn, oracle, tmp_path):
    disk = tmp_path / "nvme"
    side = spawn(nvme={"mode": "shadow", "path": str(disk), "probe_bytes": 8 << 20})
    report = poll(lambda: (n := side.stats().get("nvme")) and n["samples"] >= 1 and n, timeout_s=20)
    assert report["mode"] == "shadow" and report["serving"] is False and report["error"] is None
    assert report["measured_gbps"] == report["read_gbps"] > 0 and report["write_gbps"] > 0
    assert report["nbytes"] == 8 << 20 and report["partial"] is False
    assert list(disk.iterdir()) == []  # the probe file is gone
    client = SidecarClient(side.socket)
    assert isinstance(client.lookup(oracle.root("t"), prompt(64)), Miss)
    assert set(side.stats()["hits_by_tier"]) == {"dram", "peer"}  # no nvme tier serves
    side.config["nvme"] = {"mode": "off"}
    side.write_config()
    poll(lambda: side.stats()["nvme"] is None, timeout_s=10)


def test_nvme_probe_measures_real_io_and_reports_a_missing_path_as_an_error(tmp_path):
    from kvtier_sidecar.nvme_probe import NvmeProbe, measure
    import asyncio

    result = measure(tmp_path, 8 << 20, budget_s=10)
    assert result.nbytes == 8 << 20 and result.read_gbps > 0 and result.write_gbps > 0
    blocked = tmp_path / "file"
    blocked.write_text("a file, not a directory")
    probe = NvmeProbe(sc.NvmeConfig(mode="shadow", path=str(blocked / "nvme")))
    asyncio.run(probe.probe_once())
    assert probe.report()["measured_gbps"] is None and "Error" in probe.report()["error"]


def test_deepseek_v3_mla_override_is_one_latent_per_layer():
    ds = presets.model_preset("deepseek-v3")
    shape = sc.ServedModel(layers=ds.layers, kv_heads=ds.kv_heads, head_dim=ds.head_dim, dtype_bytes=2,
                           kv_elements_per_token=ds.kv_elements_per_token)
    assert shape.kv_bytes_per_token() == 70_272 and shape.kv_planes == 1
    with pytest.raises(ValidationError, match="kv_elements_per_token"):
        sc.ServedModel(layers=61, kv_heads=1, head_dim=576, dtype_bytes=2, kv_elements_per_token=35_000)


def test_mla_sidecar_hands_out_single_plane_blocks_and_materializes_them(spawn, oracle):
    plane = oracle.shape["layers"] * oracle.shape["kv_heads"] * oracle.shape["head_dim"]
    model = {**oracle.shape, "kv_elements_per_token": plane}
    side = spawn(model=model)
    client = SidecarClient(side.socket)
    assert client.connect()
    assert client.info["block_bytes"] == BB // 2 and client.info["block_shape"][1] == 1
    root, tokens = oracle.root("mla"), prompt(64)
    kv = np.arange(4 * BB // 2, dtype=np.uint8)
    for _ in range(2):
        client.release(client.lookup(root, tokens))
        client.store(root, tokens, kv)
    hit = client.lookup(root, tokens)
    assert isinstance(hit, EngineHit) and hit.matched_tokens == 48
    dst = np.zeros(3 * BB // 2, np.uint8)
    client.materialize(hit, dst)
    assert np.array_equal(dst, kv[: 3 * BB // 2])


def test_config_carries_peer_thrash_and_nvme_settings_into_stats(spawn):
    side = spawn(thrash_ratio=0.5)
    assert side.stats()["thrash_ratio"] == 0.5
    with pytest.raises(ValidationError, match="mode"):
        sc.from_mapping({"nvme": {"mode": "sometimes"}}, {})
    with pytest.raises(ValidationError, match="thrash_ratio"):
        sc.from_mapping({"thrash_ratio": 1.5}, {})
