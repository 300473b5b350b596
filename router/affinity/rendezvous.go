package affinity

import (
	"math"
	"sort"

	"github.com/cespare/xxhash/v2"
)

// RendezvousVersion is the scoring version this package implements; Decode
// refuses tables of any other (kvtier.rendezvous.RENDEZVOUS_VERSION).
const RendezvousVersion = 1

// Seeds and mixing constants of kvtier.rendezvous: xxh64 per name domain (so
// tenant "a" and member "a" never cancel out), then the splitmix64 finaliser.
const (
	tenantSeed uint64 = 0x6B76_7469_6572_0001
	memberSeed uint64 = 0x6B76_7469_6572_0101
	golden     uint64 = 0x9E37_79B9_7F4A_7C15
	mix1       uint64 = 0xBF58_476D_1CE4_E5B9
	mix2       uint64 = 0x94D0_49BB_1331_11EB
)

// TenantHash is the 64-bit hash of a tenant name's UTF-8 bytes.
func TenantHash(tenant string) uint64 { return seeded(tenant, tenantSeed) }

// MemberHash is the 64-bit hash of a member (replica) name's UTF-8 bytes.
func MemberHash(member string) uint64 { return seeded(member, memberSeed) }

func seeded(name string, seed uint64) uint64 {
	d := xxhash.NewWithSeed(seed)
	_, _ = d.WriteString(name) // a Digest never fails to write
	return d.Sum64()
}

// Score of member (hash mh, weight w) for tenant hash th; higher is preferred.
//
//	u     = uniform in (0, 1) from the 53 high bits of splitmix64(th ^ mh*golden)
//	score = weight / -ln(u)
//
// The arithmetic is step for step kvtier.rendezvous.score_matrix; ln may differ
// from numpy's in the last bit, so two members whose scores lie within an ulp
// or two (a chance near 2^-50 per pair) may order differently.
func Score(th, mh uint64, w float64) float64 {
	x := th ^ (mh * golden)
	x ^= x >> 30
	x *= mix1
	x ^= x >> 27
	x *= mix2
	x ^= x >> 31
	x >>= 11
	// Centred in its bucket: u is never 0 or 1, so ln(u) is finite and < 0.
	u := float64(float64(x)+0.5) * (1.0 / (1 << 53))
	return w / -math.Log(u)
}

// ranked is one table's members in sorted name order with their hashes and
// weights: what every order is computed from. Immutable once built.
type ranked struct {
	names   []string
	hashes  []uint64
	weights []float64
}

func rankMembers(members map[string]float64) ranked {
	r := ranked{names: make([]string, 0, len(members))}
	for name := range members {
		r.names = append(r.names, name)
	}
	// Byte order of UTF-8 is code point order: the order Python's sorted() gives.
	sort.Strings(r.names)
	r.hashes = make([]uint64, len(r.names))
	r.weights = make([]float64, len(r.names))
	for i, name := range r.names {
		r.hashes[i] = MemberHash(name)
		r.weights[i] = members[name]
	}
	return r
}

// order is every member in the tenant's plain rendezvous order, best first;
// equal scores keep sorted name order (a stable sort, as numpy's).
func (r ranked) order(tenant string) []string {
	th := TenantHash(tenant)
	idx := make([]int, len(r.names))
	scores := make([]float64, len(r.names))
	for i := range r.names {
		idx[i] = i
		scores[i] = Score(th, r.hashes[i], r.weights[i])
	}
	sort.SliceStable(idx, func(a, b int) bool { return scores[idx[a]] > scores[idx[b]] })
	out := make([]string, len(idx))
	for i, j := range idx {
		out[i] = r.names[j]
	}
	return out
}
