"""`GET /cache/hot` on a real sidecar process: one tenant's cached prefixes as token
ids, best first by frequency x length, within the asked budget; another tenant's
token ids never; bad input a 400 that changes nothing. (Its authentication is the
control API's: tests/sidecar/test_control_auth.py asks it too.)"""
from __future__ import annotations

import json

from kvtier import control_api as api
from kvtier_sidecar.client import EngineHit, SidecarClient

from .test_sidecar_process import prompt, seed_cache


def hot(sc, tenant: str | None, max_tokens: str | int | None) -> tuple[int, dict]:
    query = {k: v for k, v in (("tenant", tenant), ("max_tokens", None if max_tokens is None else str(max_tokens)))
             if v is not None}
    status, body = sc.get(api.HOT.url(**query))
    return status, json.loads(body)


def hits(client: SidecarClient, oracle, tenant: str, tokens, times: int) -> None:
    for _ in range(times):
        got = client.lookup(oracle.root(tenant), tokens)
        assert isinstance(got, EngineHit)
        client.release(got)


def test_hot_prompts_rank_one_tenants_prefixes_within_the_budget_and_never_another_tenants(spawn, oracle):
    sc = spawn()
    client = SidecarClient(sc.socket)
    bs = oracle.block_size
    often, seldom, long_once = prompt(2 * bs, seed=1), prompt(2 * bs, seed=2), prompt(6 * bs, seed=3)
    theirs = prompt(4 * bs, seed=4)
    try:
        for tokens in (often, seldom, long_once):
            seed_cache(client, oracle, "a", tokens)
        seed_cache(client, oracle, "b", theirs)
        hits(client, oracle, "a", often, 12)
        hits(client, oracle, "a", seldom, 1)
        hits(client, oracle, "b", theirs, 20)
    finally:
        client.close()
    before = sc.stats()

    status, answer = hot(sc, "a", 1000)
    assert status == 200, answer
    got = api.HotPrompts.model_validate(answer)
    listed = [tuple(p.token_ids) for p in got.prefixes]
    assert got.tenant == "a" and sorted(listed) == sorted(tuple(t.tolist()) for t in (often, seldom, long_once))
    # Frequency x length: the prompt hit 12 times beats the one hit once at the same length.
    assert listed.index(tuple(often.tolist())) < listed.index(tuple(seldom.tolist()))
    scores = [p.frequency * len(p.token_ids) for p in got.prefixes]
    assert scores == sorted(scores, reverse=True)
    assert got.tokens == sum(len(p) for p in listed)
    assert all(tuple(theirs.tolist()) != p for p in listed)

    # The budget bounds the answer, spent on the blocks hit most: two blocks are
    # `often`'s first (hit 12 times: a lookup never matches a prompt's last block) and
    # `seldom`'s first (hit once), not the whole of `often` (its second block never hit).
    status, answer = hot(sc, "a", 2 * bs)
    assert status == 200 and [p["token_ids"] for p in answer["prefixes"]] == [often[:bs].tolist(),
                                                                            seldom[:bs].tolist()]
    status, answer = hot(sc, "a", bs - 1)
    assert status == 200 and answer["prefixes"] == [] and answer["tokens"] == 0

    # Tenant b sees only its own; a tenant with nothing cached, nothing.
    assert [p["token_ids"] for p in hot(sc, "b", 1000)[1]["prefixes"]] == [theirs.tolist()]
    assert hot(sc, "nobody", 1000) == (200, {"tenant": "nobody", "max_tokens": 1000, "tokens": 0, "prefixes": []})

    # Bad input: 400 with what to fix; the cache and its counters unchanged.
    for tenant, budget in ((None, 10), ("a", None), ("a", 0), ("a", -5), ("a", "ten"), ("a", "1e3"),
                           ("a", api.MAX_HOT_TOKENS + 1), ("a", "²"), ("", 10), ("a/../b" * 80, 10)):
        status, answer = hot(sc, tenant, budget)
        assert status == 400, (tenant, budget, answer)
        assert "tenant" in answer["error"] or "max_tokens" in answer["error"]
    after = sc.stats()
    for key in ("lookups", "hits", "stores"):
        assert after[key] == before[key], key
    assert after["tenants"] == before["tenants"]
