"""The request stream a fleet sees: pure, seeded, generated column-wise with numpy.

Three populations with different reuse:

- template requests: one of a tenant's system prompts (200-2,000 tokens, highly
  reused) followed by a fresh user query;
- RAG requests: system prompt + a document (2,000-20,000 tokens, reused per
  document, Zipf over the tenant's documents) + a fresh query;
- conversation turns: system prompt + the transcript so far. The next turn arrives
  within ~30 s and re-sends the transcript; agent loops re-send a growing transcript
  for ~20 steps a few seconds apart.

Tenants and templates are Zipf-popular (exponent 0 is uniform). Token content is
deterministic per segment (template, document, transcript, query), so two requests
share exactly the prefix the population says they share and nothing more.

Granularity: one token element in a simulated prompt stands for `token_unit` real
tokens (1 = exact). Lengths are rounded up to whole units; everything reported is in
real tokens. A coarser unit is what lets a million requests run in a minute.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Population codes, stored per request in `Workload.kind`.
TEMPLATE, RAG, CONVERSATION, AGENT = 0, 1, 2, 3

# Odd 32-bit multipliers: segment tokens are an affine walk mod 2**32, so distinct
# segment ids start with distinct token ids and never share a first block.
_SEGMENT_MIX = 0x9E3779B1
_STEP_MIX = 0x85EBCA6B
_MASK32 = 0xFFFFFFFF

# The next conversation turn re-sends the transcript "within ~30 s" (design notes).
CONVERSATION_GAP_CAP_S = 30.0


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """What to generate. Token lengths are real tokens, (low, high) inclusive."""

    n_requests: int = 100_000
    rate_rps: float = 400.0
    n_tenants: int = 2_000
    templates_per_tenant: int = 5
    template_tokens: tuple[int, int] = (1_500, 1_500)
    tenant_zipf: float = 0.0
    template_zipf: float = 0.0
    query_tokens: tuple[int, int] = (50, 150)
    output_tokens: tuple[int, int] = (100, 300)
    rag_share: float = 0.0
    docs_per_tenant: int = 50
    doc_tokens: tuple[int, int] = (2_000, 20_000)
    doc_zipf: float = 1.0
    conversation_share: float = 0.0
    conversation_turns: tuple[int, int] = (2, 8)
    conversation_tokens: tuple[int, int] = (500, 8_000)
    conversation_gap_s: float = 10.0
    agent_share: float = 0.0
    agent_steps: tuple[int, int] = (18, 22)
    agent_gap_s: float = 2.0
    token_unit: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n_requests < 1:
            raise ValueError(f"n_requests must be >= 1, got {self.n_requests}")
        if self.rate_rps <= 0:
            raise ValueError(f"rate_rps must be > 0, got {self.rate_rps}")
        if self.n_tenants < 1 or self.templates_per_tenant < 1 or self.docs_per_tenant < 1:
            raise ValueError("n_tenants, templates_per_tenant and docs_per_tenant must be >= 1")
        if self.token_unit < 1:
            raise ValueError(f"token_unit must be >= 1, got {self.token_unit}")
        shares = (self.rag_share, self.conversation_share, self.agent_share)
        if any(s < 0 for s in shares) or sum(shares) > 1.0 + 1e-9:
            raise ValueError(f"population shares must be >= 0 and sum to <= 1, got {shares}")
        for name in ("template_tokens", "query_tokens", "output_tokens", "doc_tokens",
                     "conversation_turns", "conversation_tokens", "agent_steps"):
            lo, hi = getattr(self, name)
            if lo < 1 or hi < lo:
                raise ValueError(f"{name} must be a range (low, high) with 1 <= low <= high, got {(lo, hi)}")

    def working_set_tokens(self) -> int:
        """Distinct system-prompt tokens across all tenants (the design notes' working set)."""
        mean = (self.template_tokens[0] + self.template_tokens[1]) / 2
        return int(self.n_tenants * self.templates_per_tenant * mean)


@dataclass(slots=True)
class Workload:
    """The generated stream, one numpy column per field, sorted by arrival time.

    Lengths are in elements (one element = `spec.token_unit` real tokens).
    `doc`/`session` are -1 where a request has none; a conversation turn's prompt is
    its tenant's template followed by `session_elems` of the session transcript.
    """

    spec: WorkloadSpec
    time_s: np.ndarray
    tenant: np.ndarray
    template: np.ndarray
    kind: np.ndarray
    doc: np.ndarray
    session: np.ndarray
    session_elems: np.ndarray
    query_elems: np.ndarray
    output_tokens: np.ndarray
    template_elems: np.ndarray  # [tenant, template] -> length
    doc_elems: np.ndarray  # [tenant, doc] -> length
    _template_cache: dict = field(default_factory=dict)
    _doc_cache: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.time_s)

    def prompt_elems(self) -> np.ndarray:
        """Prompt length of every request, in elements."""
        lengths = self.template_elems[self.tenant, self.template].astype(np.int64)
        has_doc = self.doc >= 0
        lengths[has_doc] += self.doc_elems[self.tenant[has_doc], self.doc[has_doc]]
        return lengths + self.session_elems + self.query_elems

    def prompt_tokens(self) -> np.ndarray:
        """Prompt length of every request, in real tokens."""
        return self.prompt_elems() * self.spec.token_unit

    def token_builder(self):
        """A fast `tokens(i)` for the event loop, equal to `tokens(i)` element for element.

        Each prompt is joined as bytes: its template and document as one cached head,
        its transcript sliced from the longest one built so far of that session, and
        its query from a block of queries computed in one numpy pass per
        `_QUERY_CHUNK` requests (a query is the only part no other request shares)."""
        tenant, template, doc = self.tenant.tolist(), self.template.tolist(), self.doc.tolist()
        session, session_elems = self.session.tolist(), self.session_elems.tolist()
        template_tokens, doc_tokens = self._template_tokens, self._doc_tokens
        query_elems = self.query_elems.astype(np.int64)
        query_ends = np.cumsum(query_elems).tolist()
        heads: dict = {}
        transcripts: dict = {}
        chunk = [-1, 0, b""]  # chunk number, its first query element, its queries' bytes
        frombuffer, uint32 = np.frombuffer, np.uint32

        def queries_of(c: int) -> None:
            lo, hi = c * _QUERY_CHUNK, min(len(query_elems), (c + 1) * _QUERY_CHUNK)
            lens = query_elems[lo:hi]
            ids = ((3 * 1_000_003 * 1_000_033 + np.arange(lo, hi, dtype=np.uint64)) & np.uint64(_MASK32))
            offsets = ((ids * np.uint64(_SEGMENT_MIX)) & np.uint64(_MASK32)).astype(np.uint32)
            first = int(query_ends[lo - 1]) if lo else 0
            within = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
            steps = _steps_upto(int(lens.max()) if len(lens) else 0)
            chunk[:] = [c, first, (steps[within] + np.repeat(offsets, lens)).tobytes()]

        def build(i: int) -> np.ndarray:
            t, d = tenant[i], doc[i]
            key = (t, template[i], d)
            head = heads.get(key)
            if head is None:
                head = template_tokens(t, template[i]).tobytes()
                if d >= 0:
                    head += doc_tokens(t, d).tobytes()
                heads[key] = head
            parts = [head]
            n = session_elems[i]
            if n:
                skey = (t, session[i])
                seen = transcripts.get(skey)
                if seen is None or len(seen) < 4 * n:
                    if len(transcripts) >= _TRANSCRIPTS_KEPT:
                        transcripts.clear()
                    seen = transcripts[skey] = segment_tokens(_segment_id(2, t, session[i]), n).tobytes()
                parts.append(seen[:4 * n])
            end = query_ends[i]
            begin = query_ends[i - 1] if i else 0
            if end > begin:
                if chunk[0] != i // _QUERY_CHUNK:
                    queries_of(i // _QUERY_CHUNK)
                first = chunk[1]
                parts.append(chunk[2][4 * (begin - first):4 * (end - first)])
            return frombuffer(b"".join(parts), dtype=uint32)

        return build

    def tokens(self, i: int) -> np.ndarray:
        """The prompt of request `i` as uint32 token elements."""
        tenant, template = int(self.tenant[i]), int(self.template[i])
        parts = [self._template_tokens(tenant, template)]
        doc = int(self.doc[i])
        if doc >= 0:
            parts.append(self._doc_tokens(tenant, doc))
        session_len = int(self.session_elems[i])
        if session_len:
            parts.append(segment_tokens(_segment_id(2, tenant, int(self.session[i])), session_len))
        query_len = int(self.query_elems[i])
        if query_len:
            parts.append(segment_tokens(_segment_id(3, 0, i), query_len))
        return np.concatenate(parts)

    def _template_tokens(self, tenant: int, template: int) -> np.ndarray:
        key = (tenant, template)
        arr = self._template_cache.get(key)
        if arr is None:
            arr = segment_tokens(_segment_id(0, tenant, template), int(self.template_elems[tenant, template]))
            self._template_cache[key] = arr
        return arr

    def _doc_tokens(self, tenant: int, doc: int) -> np.ndarray:
        key = (tenant, doc)
        arr = self._doc_cache.get(key)
        if arr is None:
            arr = segment_tokens(_segment_id(1, tenant, doc), int(self.doc_elems[tenant, doc]))
            self._doc_cache[key] = arr
        return arr


_steps = np.zeros(0, dtype=np.uint32)
# `token_builder`: queries computed per numpy pass, and transcripts kept before the
# cache of them starts over (bounded memory; a transcript dropped is rebuilt).
_QUERY_CHUNK = 1 << 14
_TRANSCRIPTS_KEPT = 1 << 14


def _steps_upto(n: int) -> np.ndarray:
    """i * _STEP_MIX mod 2**32 for i < n at least, grown on demand and shared."""
    global _steps
    if len(_steps) < n:
        _steps = (np.arange(max(n, 2 * len(_steps)), dtype=np.uint64) * np.uint64(_STEP_MIX)).astype(np.uint32)
    return _steps


def segment_tokens(segment_id: int, n: int) -> np.ndarray:
    """Deterministic token ids of one segment; distinct ids differ from the first token."""
    return _steps_upto(n)[:n] + np.uint32((segment_id * _SEGMENT_MIX) & _MASK32)


def _segment_id(kind: int, tenant: int, index: int) -> int:
    return ((kind * 1_000_003 + tenant) * 1_000_033 + index) & _MASK32


def zipf_weights(n: int, s: float) -> np.ndarray:
    """Popularity of n items under Zipf exponent s (0 = uniform), normalised."""
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return w / w.sum()


def _elems(tokens: np.ndarray | int, unit: int) -> np.ndarray:
    return -(-np.asarray(tokens, dtype=np.int64) // unit)


def generate(spec: WorkloadSpec) -> Workload:
    """Build the request stream for `spec`; the same spec always gives the same stream."""
    rng = np.random.default_rng(spec.seed)
    unit = spec.token_unit
    template_elems = _elems(rng.integers(spec.template_tokens[0], spec.template_tokens[1] + 1,
                                         size=(spec.n_tenants, spec.templates_per_tenant)), unit)
    doc_elems = _elems(rng.integers(spec.doc_tokens[0], spec.doc_tokens[1] + 1,
                                    size=(spec.n_tenants, spec.docs_per_tenant)), unit)
    # Popularity rank is shuffled over tenant ids so that "tenant 0" is not special.
    tenant_p = zipf_weights(spec.n_tenants, spec.tenant_zipf)[rng.permutation(spec.n_tenants)]
    template_p = zipf_weights(spec.templates_per_tenant, spec.template_zipf)
    doc_p = zipf_weights(spec.docs_per_tenant, spec.doc_zipf)
    duration_s = spec.n_requests / spec.rate_rps

    n_rag = int(round(spec.n_requests * spec.rag_share))
    n_conv = int(round(spec.n_requests * spec.conversation_share))
    n_agent = int(round(spec.n_requests * spec.agent_share))
    n_single = spec.n_requests - n_rag - n_conv - n_agent
    cols = [_single_requests(rng, n_single, TEMPLATE, duration_s, spec, unit),
            _single_requests(rng, n_rag, RAG, duration_s, spec, unit, doc_p),
            _session_requests(rng, n_conv, CONVERSATION, duration_s, spec, unit, 0, tenant_p),
            _session_requests(rng, n_agent, AGENT, duration_s, spec, unit, 1 << 24, tenant_p)]
    merged = {k: np.concatenate([c[k] for c in cols]) for k in cols[0]}
    n = len(merged["time_s"])
    # Tenants and templates for requests that have none yet (sessions draw theirs per session).
    fresh = merged["tenant"] < 0
    merged["tenant"][fresh] = rng.choice(spec.n_tenants, size=int(fresh.sum()), p=tenant_p)
    merged["template"][fresh] = rng.choice(spec.templates_per_tenant, size=int(fresh.sum()), p=template_p)
    order = np.argsort(merged["time_s"], kind="stable")
    out = {k: v[order] for k, v in merged.items()}
    out["output_tokens"] = rng.integers(spec.output_tokens[0], spec.output_tokens[1] + 1, size=n).astype(np.int32)
    return Workload(spec=spec, template_elems=template_elems, doc_elems=doc_elems, **out)


def _empty_columns(n: int, kind: int) -> dict[str, np.ndarray]:
    return {
        "time_s": np.zeros(n, dtype=np.float64),
        "tenant": np.full(n, -1, dtype=np.int32),
        "template": np.full(n, -1, dtype=np.int32),
        "kind": np.full(n, kind, dtype=np.int8),
        "doc": np.full(n, -1, dtype=np.int32),
        "session": np.full(n, -1, dtype=np.int32),
        "session_elems": np.zeros(n, dtype=np.int64),
        "query_elems": np.zeros(n, dtype=np.int64),
    }


def _single_requests(rng, n, kind, duration_s, spec, unit, doc_p=None) -> dict[str, np.ndarray]:
    """Template or RAG requests: Poisson arrivals, each with a fresh query."""
    cols = _empty_columns(n, kind)
    cols["time_s"] = rng.uniform(0.0, duration_s, size=n)
    cols["query_elems"] = _elems(rng.integers(spec.query_tokens[0], spec.query_tokens[1] + 1, size=n), unit)
    if doc_p is not None:
        cols["doc"] = rng.choice(spec.docs_per_tenant, size=n, p=doc_p).astype(np.int32)
    return cols


def _session_requests(rng, n, kind, duration_s, spec, unit, session_base, tenant_p) -> dict[str, np.ndarray]:
    """Conversation turns or agent steps: each session re-sends a growing transcript."""
    cols = _empty_columns(n, kind)
    if n == 0:
        return cols
    is_agent = kind == AGENT
    turn_range = spec.agent_steps if is_agent else spec.conversation_turns
    mean_turns = (turn_range[0] + turn_range[1]) / 2
    n_sessions = int(np.ceil(n / mean_turns)) + 1
    turns = rng.integers(turn_range[0], turn_range[1] + 1, size=n_sessions)
    while turns.sum() < n:  # a short draw: top up with more sessions
        turns = np.concatenate([turns, rng.integers(turn_range[0], turn_range[1] + 1, size=n_sessions)])
    turns = turns[: int(np.searchsorted(np.cumsum(turns), n)) + 1]
    turns[-1] -= int(turns.sum() - n)
    n_sessions = len(turns)
    session_of = np.repeat(np.arange(n_sessions), turns)
    turn_index = np.arange(n) - np.repeat(np.cumsum(turns) - turns, turns)
    final_elems = _elems(rng.integers(spec.conversation_tokens[0], spec.conversation_tokens[1] + 1,
                                      size=n_sessions), unit)
    gap_mean = spec.agent_gap_s if is_agent else spec.conversation_gap_s
    gaps = np.minimum(rng.exponential(gap_mean, size=n), CONVERSATION_GAP_CAP_S)
    gaps[turn_index == 0] = 0.0
    starts = rng.uniform(0.0, duration_s, size=n_sessions)
    offsets = np.cumsum(gaps) - np.repeat(np.cumsum(gaps)[np.cumsum(turns) - turns], turns)
    cols["time_s"] = starts[session_of] + offsets
    # The transcript grows linearly to its final length; each turn re-sends all of it.
    grown = final_elems[session_of] * (turn_index + 1) // turns[session_of]
    cols["session_elems"] = np.maximum(grown, 1)
    cols["session"] = (session_of + session_base).astype(np.int32)
    tenants = rng.choice(spec.n_tenants, size=n_sessions, p=tenant_p)
    templates = rng.choice(spec.templates_per_tenant, size=n_sessions,
                           p=zipf_weights(spec.templates_per_tenant, spec.template_zipf))
    cols["tenant"] = tenants[session_of].astype(np.int32)
    cols["template"] = templates[session_of].astype(np.int32)
    return cols
