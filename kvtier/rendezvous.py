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
