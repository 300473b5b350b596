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
