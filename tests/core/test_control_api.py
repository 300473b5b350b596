"""The control API's models: strict requests, tolerant answers, one shape both sides read."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvtier import control_api as api


def test_a_warm_request_names_what_is_wrong():
    with pytest.raises(ValidationError, match=r"from_peer\n.*peer address 'not a peer' must be host:port"):
        api.WarmRequest(tenant="t", from_peer="not a peer", max_bytes=1)
    with pytest.raises(ValidationError, match="max_bytes"):
        api.WarmRequest(tenant="t", from_peer="10.0.0.1:8082", max_bytes=0)
    with pytest.raises(ValidationError, match="surprise"):
        api.WarmRequest.model_validate({"tenant": "t", "from_peer": "10.0.0.1:8082", "max_bytes": 1, "surprise": 1})


def test_answers_round_trip_and_ignore_fields_a_newer_sidecar_adds():
    stats = api.SidecarStats(lookups=4, hits=3, draining=True,
                             tenants={"t": api.TenantSummary(bytes=8, lookups=4, hits=3, warmed_bytes=0)})
    body = api.dump(stats) | {"added_later": {"x": 1}}
    back = api.SidecarStats.model_validate(body)
    assert back == stats
    job = api.Job(kind=api.JobKind.WARM, started_s=1.0, tenant="t", ref="r", asks=1)
    jobs = api.Jobs.model_validate(api.dump(api.Jobs({api.JobId("warm-1"): job})))
    assert jobs.root["warm-1"].state is api.JobState.RUNNING and jobs.root["warm-1"].ref == "r"


def test_answers_are_built_whole_a_field_the_model_lacks_is_an_error():
    with pytest.raises(ValidationError, match="served_bytes_by_tiers"):
        api.TenantStats(lookups=1, served_bytes_by_tiers={"dram": 1})
    with pytest.raises(ValidationError, match="index.added"):  # nested answers too
        api.SidecarStats(index={"enabled": True, "added": 1})
    with pytest.raises(ValidationError, match="tenant"):  # every figure of the cache report is required
        api.CacheReport.model_validate({})
    stats = api.TenantStats(lookups=2, served_bytes_by_tier={"dram": 8})
    assert api.dump(stats)["served_bytes_by_tier"] == {"dram": 8}


def test_a_newer_sidecars_fields_are_ignored_in_nested_answers_and_jobs_too():
    body = api.dump(api.SidecarStats(lookups=1)) | {"new": 1}
    body["index"] = {**body["index"], "new_counter": 2}
    back = api.SidecarStats.model_validate(body)
    assert back.lookups == 1 and not back.index.enabled
    assert api.SidecarStats.model_validate_json(b'{"lookups": 3, "new": [1]}').lookups == 3
    jobs = api.Jobs.model_validate({"warm-1": {"kind": "warm", "started_s": 1.0, "new": True}})
    assert jobs.root["warm-1"].kind is api.JobKind.WARM
