"""The checkout's demo with `--mode cluster --engine vllm`: real vLLM servers as injected serving pods
on the embedded cluster, tenants by cache_salt, every answer equal to its recompute."""
from __future__ import annotations

import pytest

from kvtier_testenv import demo_vllm

pytestmark = [pytest.mark.k8s, pytest.mark.vllm, pytest.mark.slow]


def test_vllm_pods_hit_through_injected_sidecars_and_answer_as_recompute():
    result = demo_vllm.run(requests=12, seed=1, log=print)
    assert result["errors"] == 0 and result["wrong_answers"] == 0, result["samples"]
    assert result["served"] == result["requests"] == 12
    assert result["hits"] > 0 and result["cached_tokens"] > 0
    assert sum(result["sidecar_hit_tokens"].values()) == result["cached_tokens"]
    head, row = result["kubectl_get_kvcp"].splitlines()[:2]
    assert row.split()[:2] == ["demo", "Ready"]
    # The operator's periodic refresh shows the hit rate without a membership change.
    assert 0 < result["fleet_hit_rate"] <= 1
    assert str(result["fleet_hit_rate"]) in row[head.index("HITRATE"):]
    assert result["ok"]
