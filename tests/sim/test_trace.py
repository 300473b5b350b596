"""Trace replay: the JSONL format, prompts built from hash ids, the single-cache and fleet
replays and `kvtier simulate trace`."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kvtier_app import cli
from kvtier.sim import replay, tracegen
from kvtier.sim.caches import KvtierCache
from kvtier.sim.trace import TracePrompts, TraceError, load_trace, parse_trace

LINES = [
    '{"timestamp": 1000, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]}',
    '{"timestamp": 0, "input_length": 1024, "output_length": 7, "hash_ids": [0, 1]}',
    '{"timestamp": 2000, "input_length": 600, "output_length": 1, "hash_ids": [0, 3]}',
]


def test_a_trace_is_parsed_sorted_by_arrival_keeping_only_full_blocks():
    t = parse_trace(LINES)
    assert t.time_s.tolist() == [0.0, 1.0, 2.0]
    assert [a.tolist() for a in t.ids] == [[0, 1], [0, 1], [0]]   # partial last blocks are not cacheable
    assert t.input_length.tolist() == [1024, 1100, 600] and t.prompt_tokens == 2724
    assert t.unique_blocks() == 2


@pytest.mark.parametrize("line,message", [
    ("not json", "line 1: not JSON"),
    ('{"timestamp": 0, "input_length": 10}', "line 1: output_length: Field required"),
    ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [0]}', "line 1: timestamp"),
    ('{"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [0]}', "--trace-block-tokens"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-3]}', "hash_ids must be in"),
])
def test_a_bad_line_is_a_trace_error_naming_the_line_and_the_fix(line, message):
    with pytest.raises(TraceError, match=message):
        parse_trace([line])


def test_an_empty_trace_is_an_error():
    with pytest.raises(TraceError, match="no requests"):
        parse_trace(["", "  "])


def test_prompts_sharing_their_first_ids_share_exactly_those_blocks():
    t = parse_trace([
        '{"timestamp": 0, "input_length": 1536, "output_length": 1, "hash_ids": [7, 8, 9]}',
        '{"timestamp": 1, "input_length": 1300, "output_length": 1, "hash_ids": [7, 8, 10]}',
        '{"timestamp": 2, "input_length": 1300, "output_length": 1, "hash_ids": [7, 8, 11]}',
    ])
    p = TracePrompts(t, block_elems=16)
    a, b, c = p.tokens(0), p.tokens(1), p.tokens(2)
    assert len(a) == 48 and len(b) == 32 + 276 * 16 // 512
    assert np.array_equal(a[:32], b[:32])
    assert not np.array_equal(a[32:48], b[32:48][:16]) and b[32] != a[32]
    assert b[32] != c[32]                  # two partial blocks after the same prefix differ


def test_single_cache_replay_runs_the_real_local_cache():
    cache = replay.make_cache("kvtier", 100, 16, replay._Clock())
    assert isinstance(cache, KvtierCache) and cache.cache.metadata_only
    assert cache.cache.num_slots == 100


def test_infinite_bounds_every_policy_and_belady_is_at_least_lru():
    t = tracegen.conversation(1500)
    rep = replay.sweep(t, [replay.capacity_blocks("0.05", t)], ("kvtier", "lru", "belady", "infinite"))
    by = {p.policy: p.hit_rate for p in rep.points}
    assert by["infinite"] >= max(by["kvtier"], by["lru"], by["belady"])
    assert by["belady"] >= by["lru"] and by["lru"] > 0


def test_a_sweep_in_worker_processes_reports_exactly_what_one_process_does():
    t = tracegen.conversation(800, seed=3)
    caps = [replay.capacity_blocks(c, t) for c in ("0.02", "0.1")]
    policies = ("kvtier", "kvtier-no-duel", "lru", "belady", "infinite")

    def outcome(jobs):
        rep = replay.sweep(t, caps, policies, jobs=jobs)
        return [(p.policy, p.capacity_blocks, p.matched_tokens, p.evictions, p.prompt_tokens) for p in rep.points]

    alone = outcome(1)
    assert len(alone) == 9 and sum(o[2] for o in alone) > 0
    assert outcome(2) == alone  # the same replays, in the same order


def test_capacities_are_shares_of_the_distinct_blocks_or_token_counts():
    t = parse_trace(LINES)
    assert replay.capacity_blocks("0.5", t) == 1 and replay.capacity_blocks("100%", t) == 2
    assert replay.capacity_blocks("3k", t) == 5 and replay.capacity_blocks("2048", t) == 4
    for bad in ("0", "1.5", "x", "-2", "100", "0.1k"):
        with pytest.raises(TraceError, match="capacity"):
            replay.capacity_blocks(bad, t)


def test_a_synthetic_trace_survives_the_jsonl_round_trip(tmp_path):
    t = tracegen.scan(200)
    back = load_trace(tracegen.to_jsonl(t, tmp_path / "scan.jsonl"))
    assert len(back) == len(t) and all(np.array_equal(a, b) for a, b in zip(back.ids, t.ids))
    assert back.input_length.tolist() == t.input_length.tolist()


def test_simulate_trace_writes_a_table_json_and_a_png(tmp_path, capsys):
    path = tracegen.to_jsonl(tracegen.conversation(600), tmp_path / "conv.jsonl")
    out = tmp_path / "r.json"
    rc = cli.main(["simulate", "trace", str(path), "--capacities", "0.02,0.2", "--policies", "kvtier,lru,infinite",
                   "--json", str(out), "--plots", str(tmp_path / "plots")])
    assert rc == 0
    assert "kvtier/LRU" in capsys.readouterr().out
    points = json.loads(out.read_text())["points"]
    assert {(p["policy"]) for p in points} == {"kvtier", "lru", "infinite"}
    png = tmp_path / "plots" / "trace_hit_rate_vs_capacity.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_trace_fleet_mode_runs_each_routing_policy(tmp_path):
    path = tracegen.to_jsonl(tracegen.documents(400), tmp_path / "docs.jsonl")
    out = tmp_path / "f.json"
    rc = cli.main(["simulate", "trace", str(path), "--fleet", "3", "--capacities", "0.05",
                   "--policies", "random,kvtier", "--json", str(out), "--no-progress"])
    assert rc == 0
    runs = json.loads(out.read_text())[0]["results"]
    assert [r["label"] for r in runs] == ["random", "kvtier"]
    assert all(r["prompt_tokens"] > 0 for r in runs)


def test_bad_flags_and_bad_traces_exit_2_naming_what_to_fix(tmp_path, capsys):
    good = tracegen.to_jsonl(tracegen.scan(50), tmp_path / "ok.jsonl")
    assert cli.main(["simulate", "trace", str(good), "--capacities", "2.5x"]) == 2
    assert "--capacities" in capsys.readouterr().err
    assert cli.main(["simulate", "trace", str(good), "--policies", "lru,bogus"]) == 2
    assert "--policies" in capsys.readouterr().err
    assert cli.main(["simulate", "trace", str(good), "--trace-block-tokens", "0"]) == 2
    assert "--trace-block-tokens" in capsys.readouterr().err
    assert cli.main(["simulate", "trace", str(good), "--jobs", "0"]) == 2
    assert "--jobs" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(LINES[0] + "\n{oops\n")
    assert cli.main(["simulate", "trace", str(bad)]) == 2
    assert "line 2" in capsys.readouterr().err
    assert cli.main(["simulate", "trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err
