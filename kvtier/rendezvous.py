"""Weighted rendezvous (highest-random-weight) hashing, vectorised with numpy.

Every router, the operator and the simulator must agree on a tenant's homes
without talking to each other, so the score of (tenant, member) is a pure
function of the two names and the member's weight:

    u     = uniform in (0, 1) from a 64-bit mix of xxh64(tenant) and xxh64(member)
    score = weight / -ln(u)

-ln(u) / weight is exponential with rate `weight`, so the member with the highest
score is member i with probability weight_i / sum(weights): the first home is
exactly weight-proportional. Adding a member only takes the tenants for which the
newcomer beats the current k-th score; removing one only moves the tenants it was
a home to. Hashes use fixed, versioned seeds (never Python's `hash()`), so the
order is identical across processes, hosts and releases.

Bounded loads. Plain top-k leaves some members home to far more tenants than the
mean (max/mean ~1.5 at 60 homes per member, Poisson spread). `bounded_top_k`
caps every member at balance_factor x its weighted fair share of homes the way
consistent hashing with bounded loads does, adapted to top-k: it is the stable
assignment in which each tenant proposes to members in its own rendezvous order
and a member over its cap keeps the tenants that score highest with it
(deferred acceptance). Because both sides rank by the same scores, that
assignment is unique: it does not depend on the order tenants are listed in,
so every process that knows the same tenants computes the same homes.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NewType

import numpy as np
import xxhash

TenantId = NewType("TenantId", str)
MemberName = NewType("MemberName", str)

# Bump when the scoring changes: routers must refuse a table of another version
# rather than silently disagree with the operator about homes.
RENDEZVOUS_VERSION = 1
# Distinct seeds per name domain, so tenant "a" and member "a" never cancel out.
_TENANT_SEED = 0x6B76_7469_6572_0001  # "kvtier" + version
_MEMBER_SEED = 0x6B76_7469_6572_0101
# splitmix64 finaliser constants: a full-avalanche 64-bit bijection.
_GOLDEN = np.uint64(0x9E37_79B9_7F4A_7C15)
_MIX1 = np.uint64(0xBF58_476D_1CE4_E5B9)
_MIX2 = np.uint64(0x94D0_49BB_1331_11EB)
# Tenants per chunk in the many-tenant path: keeps the [chunk, members] float
# matrices inside the CPU caches instead of streaming hundreds of MB.
_CHUNK_ELEMENTS = 1 << 17
# Caps round balance_factor x fair share to whole homes; a product like 74.9999999
# (or 75.0000001) from float rounding must not cost or buy a member a home.
_CAP_ROUNDING = 1e-9


def tenant_hash(tenant: str) -> int:
    """64-bit hash of a tenant name (UTF-8), seeded for the tenant domain."""
    return xxhash.xxh64_intdigest(_utf8(tenant, "tenant"), seed=_TENANT_SEED)


def member_hash(member: str) -> int:
    """64-bit hash of a member (replica) name (UTF-8), seeded for the member domain."""
    return xxhash.xxh64_intdigest(_utf8(member, "member"), seed=_MEMBER_SEED)


def tenant_hashes(tenants: Sequence[str]) -> np.ndarray:
    return np.fromiter((tenant_hash(t) for t in tenants), dtype=np.uint64, count=len(tenants))


def member_hashes(members: Sequence[str]) -> np.ndarray:
    return np.fromiter((member_hash(m) for m in members), dtype=np.uint64, count=len(members))


def check_weights(weights: np.ndarray | Sequence[float]) -> np.ndarray:
    """Weights as float64; ValueError unless every weight is finite and > 0."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1:
        raise ValueError("member weights must be a flat sequence")
    if not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"member weights must be finite and > 0, got {w.tolist()[:8]}")
    return w


def score_matrix(t_hashes: np.ndarray, m_hashes: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Scores [len(t_hashes), len(m_hashes)], float64; higher means preferred."""
    with np.errstate(over="ignore"):
        x = m_hashes * _GOLDEN
        x = t_hashes[:, None] ^ x[None, :]
        y = x >> np.uint64(30)
        x ^= y
        x *= _MIX1
        np.right_shift(x, np.uint64(27), out=y)
        x ^= y
        x *= _MIX2
        np.right_shift(x, np.uint64(31), out=y)
        x ^= y
        x >>= np.uint64(11)
    # 53 high bits, centred in their bucket: u is never 0 or 1, so ln(u) is finite and < 0.
    u = x.astype(np.float64)
    u += 0.5
    u *= 1.0 / (1 << 53)
    np.log(u, out=u)
    np.negative(u, out=u)
    return np.divide(weights[None, :], u, out=u)


def ranking(tenant: str, members: Mapping[str, float]) -> list[str]:
    """All members in the tenant's rendezvous order, best first.

    Members are taken in sorted name order, so equal scores (astronomically rare)
    resolve the same way whatever order the mapping was built in.
    """
    names = sorted(members)
    if not names:
        return []
    w = check_weights([members[m] for m in names])
    s = score_matrix(np.array([tenant_hash(tenant)], dtype=np.uint64), member_hashes(names), w)[0]
    return [names[i] for i in _order_desc(s)]


def top_k(tenant: str, members: Mapping[str, float], k: int) -> list[str]:
    """The tenant's k homes (fewer if there are fewer members), best first."""
    _check_k(k)
    return ranking(tenant, members)[:k]


def top_k_many(
    t_hashes: np.ndarray, m_hashes: np.ndarray, weights: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Top-k member indices and their scores for many tenants at once.

    Returns (homes [T, k'] int32 indices into the member arrays, best first;
    scores [T, k'] float64), with k' = min(k, members). Equal scores resolve to
    the lower member index, so pass members in sorted name order to agree with
    `ranking`. Processed in chunks of tenants so memory stays bounded for 20k
    tenants x 1k members.
    """
    _check_k(k)
    n_t, n_m = len(t_hashes), len(m_hashes)
    kk = min(k, n_m)
    homes = np.empty((n_t, kk), dtype=np.int32)
    scores = np.empty((n_t, kk), dtype=np.float64)
    if n_t == 0 or kk == 0:
        return homes, scores
    w = check_weights(weights)
    step = max(1, _CHUNK_ELEMENTS // n_m)
    for lo in range(0, n_t, step):
        s = score_matrix(t_hashes[lo : lo + step], m_hashes, w)
        rows = np.arange(len(s))
        # k is small (homes per tenant): k argmax passes beat a partition by ~10x.
        # argmax takes the lowest index among equal scores, as `ranking` does.
        for j in range(kk):
            best = s.argmax(axis=1)
            homes[lo : lo + step, j] = best
            scores[lo : lo + step, j] = s[rows, best]
            s[rows, best] = -np.inf
    return homes, scores


def home_caps(
    weights: np.ndarray | Sequence[float], n_tenants: int, k: int, balance_factor: float
) -> np.ndarray:
    """Most homes each member may hold, int64: the whole number of homes within
    balance_factor x its fair share, but never below the fair share rounded up.

    Fair share = k' x n_tenants x weight / total weight (k' = min(k, members)),
    water-filled: a member can be home to each tenant at most once, so a share
    above n_tenants is clipped and the excess spread over the others by weight.
    The rounding up keeps the sum of caps >= k' x n_tenants, so the homes fit;
    it only exceeds balance_factor x share when the share is below
    1 / (balance_factor - 1) homes (4 at the default 1.25), where whole homes
    cannot do better.
    """
    _check_k(k)
    if not balance_factor >= 1.0:
        raise ValueError(f"balance factor must be >= 1 (caps at or above the fair share), got {balance_factor!r}")
    w = check_weights(weights)
    share = np.zeros(len(w))
    free = np.ones(len(w), dtype=bool)
    remaining = float(min(k, len(w)) * n_tenants)
    while free.any():
        proposed = remaining * w[free] / w[free].sum()
        clipped = proposed > n_tenants
        if not clipped.any():
            share[free] = proposed
            break
        idx = np.flatnonzero(free)[clipped]
        share[idx] = n_tenants
        free[idx] = False
        remaining -= n_tenants * len(idx)
    within = np.floor(balance_factor * share + _CAP_ROUNDING)
    fits = np.ceil(share - _CAP_ROUNDING)
    return np.minimum(np.maximum(within, fits), n_tenants).astype(np.int64)


def bounded_top_k(
    t_hashes: np.ndarray,
    m_hashes: np.ndarray,
    weights: np.ndarray,
    k: int,
    caps: np.ndarray,
    candidates: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, int]:
    """Every tenant's k homes with no member above its cap (see module doc).

    Deferred acceptance, vectorised by rounds:

        propose   every tenant holds its first k members      (plain top k)
        reject    a member above its cap turns away the tenants that score
                  lowest with it, down to its cap
        repropose a tenant turned away r times proposes to the next r
                  members of its own order; back to `reject`
        complete  stranded tenants (only with near-infeasible caps) swap in

    Rounds stop when no member is above its cap; each round moves only the
    turned-away tenants, so a few rounds settle 20,000 tenants.

    `candidates` is `top_k_many(..., depth)` for these tenants and members with
    depth >= k (computed here if absent); tenants pushed past their candidates
    are ranked deeper on demand. Returns (homes [T, k'] int32, best first; the
    number of tenants left above a cap because no swap could make room: 0
    unless the caps are infeasible, e.g. k close to the member count with
    lopsided weights).
    """
    _check_k(k)
    n_t, n_m = len(t_hashes), len(m_hashes)
    kk = min(k, n_m)
    if candidates is None:
        candidates = top_k_many(t_hashes, m_hashes, weights, kk)
    ranked = _Candidates(t_hashes, m_hashes, weights, *candidates)
    if n_t == 0 or kk == 0 or kk == n_m:
        return ranked.members[:, :kk].copy(), 0
    caps = np.asarray(caps, dtype=np.int64)

    tenant = np.repeat(np.arange(n_t), kk)
    member = ranked.members[:, :kk].ravel().astype(np.int64)
    score = ranked.scores[:, :kk].ravel().copy()
    next_col = np.full(n_t, kk, dtype=np.int64)
    while True:
        rejected = _over_cap(tenant, member, score, t_hashes, caps, n_m)
        if not len(rejected):
            break
        rej_tenants = tenant[rejected]
        keep = np.ones(len(tenant), dtype=bool)
        keep[rejected] = False
        tenant, member, score = tenant[keep], member[keep], score[keep]
        rows, cols = _next_proposals(rej_tenants, next_col, n_t)
        live = cols < n_m  # a tenant rejected by every member stays short
        rows, cols = rows[live], cols[live]
        ranked.ensure_depth(rows, cols)
        tenant = np.concatenate([tenant, rows])
        member = np.concatenate([member, ranked.members[rows, cols].astype(np.int64)])
        score = np.concatenate([score, ranked.scores[rows, cols]])
    tenant, member, score, over_cap = _complete_stranded(tenant, member, score, kk, n_t, ranked, caps)
    order = np.lexsort((-score, tenant))
    return member[order].reshape(n_t, kk).astype(np.int32), over_cap


class _Candidates:
    """A tenant x member ranking known to a per-row depth, deepened on demand."""

    __slots__ = ("t_hashes", "m_hashes", "weights", "members", "scores", "depth")

    def __init__(self, t_hashes, m_hashes, weights, members, scores):
        self.t_hashes, self.m_hashes, self.weights = t_hashes, m_hashes, weights
        self.members, self.scores = members, scores
        self.depth = np.full(len(t_hashes), members.shape[1], dtype=np.int64)

    def ensure_depth(self, rows: np.ndarray, cols: np.ndarray) -> None:
        """Rank `rows` at least to column `cols` (copying, never writing the caller's arrays)."""
        short = cols >= self.depth[rows]
        if not short.any():
            return
        need_rows = np.unique(rows[short])
        n_m = len(self.m_hashes)
        width = int(min(n_m, max(2 * self.members.shape[1], int(cols.max()) + 1)))
        if width > self.members.shape[1]:
            pad = width - self.members.shape[1]
            self.members = np.pad(self.members, ((0, 0), (0, pad)), constant_values=-1)
            self.scores = np.pad(self.scores, ((0, 0), (0, pad)), constant_values=-np.inf)
        else:
            self.members, self.scores = self.members.copy(), self.scores.copy()
        h, s = top_k_many(self.t_hashes[need_rows], self.m_hashes, self.weights, width)
        self.members[need_rows, :width], self.scores[need_rows, :width] = h, s
        self.depth[need_rows] = width


def _over_cap(tenant, member, score, t_hashes, caps, n_m) -> np.ndarray:
    """Positions of the proposals members over their cap turn down: each keeps its
    cap best by score (ties: lower tenant hash), so the outcome is order-free."""
    load = np.bincount(member, minlength=n_m)
    over = load > caps
    if not over.any():
        return np.empty(0, dtype=np.int64)
    at = np.flatnonzero(over[member])
    at = at[np.lexsort((t_hashes[tenant[at]], -score[at], member[at]))]
    m_sorted = member[at]
    rank = np.arange(len(at)) - np.searchsorted(m_sorted, m_sorted, side="left")
    return at[rank >= caps[m_sorted]]


def _next_proposals(rej_tenants: np.ndarray, next_col: np.ndarray, n_t: int) -> tuple[np.ndarray, np.ndarray]:
    """A tenant turned down r times proposes to its next r members in its order."""
    counts = np.bincount(rej_tenants, minlength=n_t)
    who = np.flatnonzero(counts)
    c = counts[who]
    rows = np.repeat(who, c)
    offsets = np.arange(len(rows)) - np.repeat(np.cumsum(c) - c, c)
    cols = next_col[rows] + offsets
    next_col[who] += c
    return rows, cols


def _complete_stranded(tenant, member, score, kk, n_t, ranked: _Candidates, caps):
    """Complete the tenants every member turned down (only when caps are tight).

    Deferred acceptance can strand a tenant whose only members with room are
    its own homes. For each such tenant, in tenant-hash order: take a full
    member x in its order and move one of x's tenants u (lowest score with x
    first) to a member y with room that u lacks; the stranded tenant takes x.
    No cap moves. A tenant no swap can complete takes its best-ranked other
    members over the cap, and is counted.
    """
    held = np.bincount(tenant, minlength=n_t)
    short = np.flatnonzero(held < kk)
    if not len(short):
        return tenant, member, score, 0
    n_m = len(ranked.m_hashes)
    ranked.ensure_depth(short, np.full(len(short), n_m - 1))
    homes: list[dict[int, float]] = [{} for _ in range(n_t)]
    at: list[set[int]] = [set() for _ in range(n_m)]
    for t, m, sc in zip(tenant.tolist(), member.tolist(), score.tolist()):
        homes[t][m] = sc
        at[m].add(t)
    load = np.bincount(member, minlength=n_m)
    over_cap = 0
    for t in sorted(short.tolist(), key=lambda i: int(ranked.t_hashes[i])):
        order = [int(m) for m in ranked.members[t, :n_m]]
        while len(homes[t]) < kk and _swap_in(t, order, homes, at, load, caps, ranked):
            pass
        if len(homes[t]) < kk:
            over_cap += 1
            for col, m in enumerate(order):
                if len(homes[t]) == kk:
                    break
                if m not in homes[t]:
                    homes[t][m] = float(ranked.scores[t, col])
                    at[m].add(t)
                    load[m] += 1
    pairs = [(t, m, sc) for t in range(n_t) for m, sc in homes[t].items()]
    t_arr, m_arr, s_arr = (np.array(x) for x in zip(*pairs))
    return t_arr.astype(np.int64), m_arr.astype(np.int64), s_arr.astype(np.float64), over_cap


def _swap_in(t, order, homes, at, load, caps, ranked: _Candidates) -> bool:
    """One swap that gives tenant t another home without raising any load (see `_complete_stranded`)."""
    room = [m for m in range(len(load)) if load[m] < caps[m]]
    for col, x in enumerate(order):
        if x in homes[t]:
            continue
        if load[x] < caps[x]:
            homes[t][x] = float(ranked.scores[t, col])
            at[x].add(t)
            load[x] += 1
            return True
        movable = sorted(at[x], key=lambda u: (homes[u][x], int(ranked.t_hashes[u])))
        for u in movable:
            targets = [y for y in room if y not in homes[u]]
            if not targets:
                continue
            y_scores = score_matrix(ranked.t_hashes[[u]], ranked.m_hashes[targets], ranked.weights[targets])[0]
            best = int(np.argmax(y_scores))
            y = targets[best]
            del homes[u][x]
            at[x].discard(u)
            homes[u][y] = float(y_scores[best])
            at[y].add(u)
            load[y] += 1
            homes[t][x] = float(ranked.scores[t, col])
            at[x].add(t)
            return True
    return False


def _order_desc(scores: np.ndarray) -> np.ndarray:
    # Stable sort of -score: equal scores keep member order, so ties are deterministic.
    return np.argsort(-scores, kind="stable")


def _check_k(k: int) -> None:
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k (homes per tenant) must be an integer >= 1, got {k!r}")


def _utf8(name: str, what: str) -> bytes:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what} name must be a non-empty string, got {name!r}")
    return name.encode("utf-8")
