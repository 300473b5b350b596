"""A warm-up's plan (rule: warm-up plan): which prompts a pod about to take traffic
replays through its own engine, within a token budget. Pure: the operator's
warm-before-ready (kvtier_operator.rollout_warmup) and the simulator's model of it
(kvtier.sim.loop) both run this one definition.

A tenant's candidates (`tenant_prompts`) come from the pod's OWN sidecar, read just
before it restarted (`keep_own`: the operator's snapshot), and from the tenant's other
homes; every prompt is cut to the prefix its tenant's prompts share (`cut_to_shared`),
weighted (own prompts as first-home prompts: their frequency is this pod's own traffic),
deduplicated and ranked; then `plan` spends the pod's budget across its tenants."""
from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prefix to replay: its token ids and its decayed hit frequency."""

    tokens: tuple[int, ...]
    frequency: float

    @property
    def value(self) -> float:
        """The prefill a hit on it saves per unit of time: frequency x length."""
        return self.frequency * len(self.tokens)


def rank(answers: Iterable[Sequence[Prompt]]) -> list[Prompt]:
    """Several sources' prompts as one list: the same token ids once (the highest
    frequency seen), best first by frequency x length, ties longer first."""
    best: dict[tuple[int, ...], float] = {}
    for answer in answers:
        for p in answer:
            if p.tokens:
                best[p.tokens] = max(best.get(p.tokens, 0.0), p.frequency)
    return sorted((Prompt(t, f) for t, f in best.items()), key=lambda p: (-p.value, -len(p.tokens), p.tokens))


# A tenant's traffic goes to its FIRST home (`kvtier.routing.pick`); its other homes see
# it only while the first runs hot (spill: occupancy above spillOccupancy and above
# balanceFactor x the fleet mean, which a fleet sized to ~0.7 mean occupancy under the
# 0.85 threshold rarely is) or is itself restarted. The routing has no spill model to
# read a share from, so this is an estimate, on the generous side: a pod that is only
# another home of a tenant expects about a tenth of its traffic, so a prompt of such a
# tenant is warmed before a first-home tenant's only if it saves ten times as much.
OTHER_HOME_WEIGHT = 0.1
# The least a tenant's sources are asked for, in tokens: one long prompt (a system
# prompt or a document template of a few thousand tokens, with room to spare). An ask
# below the tenant's prompt lengths returns nothing at all: the sidecar lists whole
# prefixes only.
ASK_FLOOR_TOKENS = 8_192


@dataclass(frozen=True, slots=True)
class Planned:
    """One prompt to replay: `new_tokens` of it are not already in a prompt replayed
    before it (what the budget is charged), `after` the index in the plan of the
    prompt whose prefix it reuses (replay it once that one is done), None if none."""

    tenant: str
    prompt: Prompt
    new_tokens: int
    after: int | None = None


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def plan(candidates: Mapping[str, tuple[float, Sequence[Prompt]]], max_tokens: int,
         block: int = 1) -> list[Planned]:
    """The pod's warm-up: every tenant's candidate prompts (`candidates`: tenant ->
    (its weight on the pod, `home_weights`; its prompts, `rank`)) in one pool, chosen
    greedily by expected saving — weight x frequency x the tokens not already warmed
    (a prompt that shares a prefix with a chosen prompt of its tenant is charged only
    the rest: the engine finds the shared prefix cached) — while the tokens charged
    fit `max_tokens`. Returned in the order chosen, the most valuable first (a deadline
    cuts the least valuable), each prompt once. Prefixes never cross tenants (each
    tenant's prompts are replayed under its own cache_salt). `block`: the engine's KV
    block in tokens (`spec.blockSize`): it finds a shared prefix's whole blocks cached
    and computes the partial one again, so only whole blocks count as shared and what
    is charged is what the engine prefills."""
    left, block = max(0, max_tokens), max(1, block)
    pool: list[tuple[str, float, Prompt]] = []
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for t in sorted(candidates):
        w, prompts = candidates[t]
        for p in prompts:
            if p.tokens and (t, p.tokens) not in seen:
                seen.add((t, p.tokens))
                pool.append((t, w, p))
    shared = [0] * len(pool)  # tokens of candidate i already in a chosen prompt
    source: list[int | None] = [None] * len(pool)  # the chosen prompt (plan index) they come from
    version = [0] * len(pool)
    by_tenant: dict[str, list[int]] = {}
    for i, (t, _, _) in enumerate(pool):
        by_tenant.setdefault(t, []).append(i)

    def entry(i: int) -> tuple:
        t, w, p = pool[i]
        new = len(p.tokens) - shared[i]
        return (-(w * p.frequency * new), -new, t, p.tokens, version[i], i)

    heap = [entry(i) for i in range(len(pool))]
    heapq.heapify(heap)
    done = [False] * len(pool)
    out: list[Planned] = []
    while heap and left > 0:
        *_, v, i = heapq.heappop(heap)
        if done[i] or v != version[i]:
            continue
        t, _, p = pool[i]
        new = len(p.tokens) - shared[i]
        if new <= 0:
            done[i] = True
            continue
        if new > left:
            continue  # may fit later, if a prompt chosen after it shares more of it
        done[i] = True
        left -= new
        out.append(Planned(t, p, new, source[i]))
        for j in by_tenant[t]:
            if done[j]:
                continue
            c = _common(pool[j][2].tokens, p.tokens) // block * block
            if c > shared[j]:
                shared[j], source[j] = c, len(out) - 1
                version[j] += 1
                heapq.heappush(heap, entry(j))
    return out


def cut_to_shared(answers: Sequence[Sequence[Prompt]], block: int = 1) -> list[list[Prompt]]:
    """Every prompt cut to the longest whole-block prefix it shares with another prompt
    of the same tenant (`answers`: one tenant's, any source); a prompt sharing no whole
    block stays whole. Why: the sidecar lists leaves (a template plus one request's own
    question), so ranking whole leaves replays the template once per leaf and spends
    the budget on questions that never come again; cut, the template is one prompt
    (`rank` keeps it once) and the budget reaches more templates. Measured in the
    simulator (bench/notes/rollout-warmup-plan.md): the restarted pod's first minute
    0.778 with whole prompts, 0.791 cut, on half the prefill."""
    block = max(1, block)
    ordered = sorted({p.tokens for answer in answers for p in answer if p.tokens})
    shared: dict[tuple[int, ...], int] = {}
    # In sorted order, the prompt sharing the longest prefix with one is a neighbour.
    for i, t in enumerate(ordered):
        near = [_common(t, ordered[j]) for j in (i - 1, i + 1) if 0 <= j < len(ordered)]
        shared[t] = max(near, default=0) // block * block
    return [[Prompt(p.tokens[:shared[p.tokens]] if shared[p.tokens] else p.tokens, p.frequency)
             for p in answer if p.tokens] for answer in answers]


# The weight of the prompts read from the pod's OWN sidecar before it restarted: their
# frequency is the traffic this very pod served (a tenant's first home sees all of it,
# another home only its spill), so they are not discounted again by the pod's rank in
# the tenant's homes; they weigh as a first-home tenant's prompts.
OWN_WEIGHT = 1.0


def tenant_prompts(own: Sequence[Prompt] | None, others: Sequence[Sequence[Prompt]], weight: float,
                   block: int = 1) -> list[Prompt]:
    """One tenant's candidates on the pod, for `plan` at weight 1: the pod's own
    snapshot (`own`: `keep_own`'s, already cut; None: none) at `OWN_WEIGHT` and the
    other sources' answers at the tenant's `weight` on the pod (`home_weights`), cut to
    the prefixes they share with each other or with the snapshot (`cut_to_shared`; the
    snapshot is not cut twice: two cut templates sharing a system prompt would shrink
    to it), each frequency times its source's weight, the same token ids once (the
    best), ranked (`rank`)."""
    mine = [p for p in own or () if p.tokens]
    cut = cut_to_shared([mine, *others], block)[1:]
    weighted = [[Prompt(p.tokens, p.frequency * OWN_WEIGHT) for p in mine]]
    weighted += [[Prompt(p.tokens, p.frequency * weight) for p in answer] for answer in cut]
    return rank(weighted)


def keep_own(answers: Mapping[str, Sequence[Prompt]], max_tokens: int, block: int = 1) -> dict[str, list[Prompt]]:
    """What the operator keeps of a pod's own hot list, read before it restarts
    (tenant -> its prefixes): the prompts `plan` would replay from them alone within
    the pod's budget (cut to shared prefixes, at `OWN_WEIGHT`), with their frequencies.
    Merged later with the other sources, a prompt left out here ranks lower still, so
    nothing the warm-up could use is dropped, and what is held in memory stays within
    about the budget per pod instead of every tenant's whole ask."""
    candidates = {t: (OWN_WEIGHT, rank(cut_to_shared([p], block))) for t, p in answers.items()}
    kept: dict[str, list[Prompt]] = {}
    for item in plan(candidates, max_tokens, block):
        kept.setdefault(item.tenant, []).append(item.prompt)
    return kept


def ask_tokens(max_tokens: int, tenants: int, floor: int = ASK_FLOOR_TOKENS) -> int:
    """How many tokens to ask each of a tenant's sources for: twice its even share of
    the budget, at least `floor` (an even share can be below one prompt of the
    tenant's, and the sidecar lists whole prefixes only), never more than the whole
    budget. So what is asked in all stays within SOURCES x max(2 x budget +
    2 x tenants, tenants x floor) token ids, and `plan` picks across it."""
    if tenants <= 0 or max_tokens <= 0:
        return 0
    return min(max_tokens, max(floor, 2 * -(-max_tokens // tenants)))
