"""The request stream: deterministic, shaped like the three populations."""
import numpy as np
import pytest

from kvtier.sim.workload import AGENT, CONVERSATION, RAG, TEMPLATE, WorkloadSpec, generate


def _spec(**kw):
    base = dict(n_requests=3_000, n_tenants=20, rag_share=0.2, conversation_share=0.2, agent_share=0.2, seed=7)
    base.update(kw)
    return WorkloadSpec(**base)


def test_same_spec_gives_the_same_stream():
    a, b = generate(_spec()), generate(_spec())
    assert np.array_equal(a.time_s, b.time_s) and np.array_equal(a.tenant, b.tenant)
    assert all(np.array_equal(a.tokens(i), b.tokens(i)) for i in (0, 17, 2_999))


def test_stream_is_time_ordered_with_exact_count_and_population_shares():
    w = generate(_spec())
    assert len(w) == 3_000
    assert np.all(np.diff(w.time_s) >= 0)
    counts = np.bincount(w.kind, minlength=4)
    assert counts[RAG] == counts[CONVERSATION] == counts[AGENT] == 600
    assert counts[TEMPLATE] == 1_200


def test_a_conversation_turn_resends_the_previous_turn_as_its_prefix():
    w = generate(_spec())
    conv = np.flatnonzero(w.kind == AGENT)
    session = w.session[conv[0]]
    turns = [i for i in conv if w.session[i] == session]
    assert len(turns) >= 2
    for earlier, later in zip(turns, turns[1:]):
        a, b = w.tokens(earlier), w.tokens(later)
        assert len(b) >= len(a)
        assert np.array_equal(b[: len(a)], a)
        assert w.time_s[later] - w.time_s[earlier] <= 30.0


def test_requests_of_one_template_share_it_and_differ_after_it():
    w = generate(_spec(rag_share=0.0, conversation_share=0.0, agent_share=0.0))
    same = [i for i in range(len(w)) if (w.tenant[i], w.template[i]) == (w.tenant[0], w.template[0])][:2]
    n = int(w.template_elems[w.tenant[0], w.template[0]])
    a, b = w.tokens(same[0]), w.tokens(same[1])
    assert np.array_equal(a[:n], b[:n])
    assert a[n] != b[n]


def test_distinct_templates_start_with_distinct_tokens():
    w = generate(_spec(n_tenants=50))
    firsts = {int(w._template_tokens(t, k)[0]) for t in range(50) for k in range(5)}
    assert len(firsts) == 250


def test_token_unit_scales_lengths_down():
    fine = generate(_spec(token_unit=1))
    coarse = generate(_spec(token_unit=16))
    ratio = fine.prompt_elems().sum() / coarse.prompt_elems().sum()
    assert 14 < ratio <= 16


@pytest.mark.parametrize("bad", [dict(rag_share=0.7, agent_share=0.5), dict(doc_tokens=(10, 5)),
                                 dict(n_requests=0), dict(rate_rps=0), dict(token_unit=0)])
def test_bad_spec_is_a_value_error(bad):
    with pytest.raises(ValueError):
        _spec(**bad)


def test_the_event_loops_builder_gives_every_prompt_exactly(monkeypatch):
    """`token_builder` joins cached bytes and per-chunk queries; it must equal `tokens(i)`
    element for element, across query chunks, transcript evictions, random order and
    requests without a query, document or transcript."""
    import kvtier.sim.workload as workload
    monkeypatch.setattr(workload, "_QUERY_CHUNK", 97)
    monkeypatch.setattr(workload, "_TRANSCRIPTS_KEPT", 5)
    w = generate(_spec())
    assert (w.session >= 0).any() and (w.doc >= 0).any() and (w.query_elems == 0).any()
    build = w.token_builder()
    order = list(range(len(w))) + np.random.default_rng(0).permutation(len(w)).tolist()
    for i in order:
        got, want = build(i), w.tokens(i)
        assert got.dtype == want.dtype and np.array_equal(got, want), i
