package affinity

import (
	"errors"
	"slices"
	"sync"
	"unicode/utf8"
)

var (
	// ErrNoMembers: the table has no members, so there is nowhere to route.
	ErrNoMembers = errors.New("affinity table has no members: nowhere to route")
	// ErrBadTenant: the tenant name is empty or not valid UTF-8 (it cannot be hashed
	// the way every other reader hashes it).
	ErrBadTenant = errors.New("tenant name must be a non-empty UTF-8 string")
)

// OrderFor is every member in the tenant's order, best first: its homes, then
// its spill path (the rest in rendezvous order). Empty for a table with no
// members (for any tenant); ErrBadTenant otherwise for a name that cannot be hashed.
func (t *Table) OrderFor(tenant string) ([]string, error) {
	if len(t.ranked.names) == 0 {
		return nil, nil
	}
	if tenant == "" || !utf8.ValidString(tenant) {
		return nil, ErrBadTenant
	}
	order := t.ranked.order(tenant)
	homes, ok := t.overrides[tenant]
	if !ok {
		return order, nil
	}
	out := append(make([]string, 0, len(order)), homes...)
	for _, m := range order {
		if !slices.Contains(homes, m) {
			out = append(out, m)
		}
	}
	return out, nil
}

// HomesFor is the tenant's k homes, best first (every member if there are fewer
// than k): its override if the table has one, else plain rendezvous.
func (t *Table) HomesFor(tenant string) ([]string, error) {
	if homes, ok := t.overrides[tenant]; ok {
		return append([]string(nil), homes...), nil
	}
	order, err := t.OrderFor(tenant)
	if err != nil {
		return nil, err
	}
	return order[:min(t.homes, len(order))], nil
}

// Pick is where one request goes. Rank is the member's position in the
// tenant's order (0 = first home); Spilled means it is not one of the homes.
// A screened pick (PickVersioned) reports the same, against the tenant's
// whole order and homes: a member of its version past its homes is a spill,
// even when every home of that version is cool and the others are on the
// other version (it holds none of the tenant's prefixes either way).
type Pick struct {
	Member  string
	Rank    int
	Spilled bool
	Epoch   int64
}

// SpillState is one router's memory of tenants routed off their first choice:
// tenant -> the member it moved to, under one epoch (a new epoch forgets all).
// It holds at most one entry per tenant currently routed off its first choice.
// Safe for concurrent use; the zero value is not ready, use NewSpillState.
type SpillState struct {
	mu      sync.Mutex
	epoch   int64
	movedTo map[string]string
}

// NewSpillState is an empty state that belongs to no epoch yet.
func NewSpillState() *SpillState { return &SpillState{epoch: -1, movedTo: map[string]string{}} }

// Epoch the state's decisions were made under (-1 before the first pick).
func (s *SpillState) Epoch() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.epoch
}

// MovedTo is a copy of the tenants routed off their first choice and where.
func (s *SpillState) MovedTo() map[string]string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]string, len(s.movedTo))
	for k, v := range s.movedTo {
		out[k] = v
	}
	return out
}

// Pick chooses the member for one request of tenant: the first member in its
// order that is not hot, where
//
//	hot(m)  = occ(m) > spillOccupancy  AND  occ(m) > balanceFactor x fleet mean
//	cool(m) = occ(m) < spillOccupancy - hysteresis  OR  occ(m) < balanceFactor x mean - hysteresis
//
// With a state (nil for none), a member ranked above the tenant's sticky spill
// target must be cool, not merely not hot, so a home hovering at the threshold
// does not flap. occupancy maps member -> KV occupancy in [0, 1]; members
// without a report count as empty and are left out of the mean. Decisions are
// those of kvtier.routing.pick; on error the state is unchanged.
func (t *Table) Pick(tenant string, occupancy map[string]float64, state *SpillState) (Pick, error) {
	return t.PickVersioned(tenant, occupancy, state, nil)
}

// PickVersioned is Pick over the tenant's order screened by versions (member
// -> the weights version its pod serves; see Screen): while a rollout runs, a
// tenant is walked only over the members of its first home's version. The
// spill memory is kept over the screened order (a tenant "moved off its first
// choice" left the first member of its version); Rank and Spilled are against
// the whole order. A nil or empty versions is Pick exactly. Decisions are
// those of kvtier.routing.pick with versions.
func (t *Table) PickVersioned(tenant string, occupancy map[string]float64, state *SpillState, versions map[string]string) (Pick, error) {
	if len(t.ranked.names) == 0 {
		return Pick{}, ErrNoMembers
	}
	order, err := t.OrderFor(tenant)
	if err != nil {
		return Pick{}, err
	}
	walked := order
	if len(versions) > 0 {
		walked = Screen(order, versions)
	}
	g := t.gate(occupancy)
	if state == nil {
		return t.result(order, walked, walk(walked, g, -1)), nil
	}
	state.mu.Lock()
	defer state.mu.Unlock()
	if state.epoch != t.epoch {
		clear(state.movedTo)
		state.epoch = t.epoch
	}
	stickyRank := -1
	if sticky, ok := state.movedTo[tenant]; ok {
		stickyRank = slices.Index(walked, sticky)
	}
	chosen := walk(walked, g, stickyRank)
	if chosen == 0 {
		delete(state.movedTo, tenant)
	} else {
		state.movedTo[tenant] = walked[chosen]
	}
	return t.result(order, walked, chosen), nil
}

// result is the pick of walked[chosen], ranked in the tenant's whole order.
func (t *Table) result(order, walked []string, chosen int) Pick {
	rank := chosen
	if len(walked) != len(order) {
		rank = slices.Index(order, walked[chosen])
	}
	return Pick{Member: order[rank], Rank: rank, Spilled: rank >= t.homes, Epoch: t.epoch}
}

// Screen is the members of order a tenant may be routed to while its pods'
// weights versions differ: those whose version is that of the first member of
// order that has one (its first home, unless that pod's version is unknown).
// Once that version is known, members without one are dropped; when no member
// of order has a version, order is returned as it is. The result is never
// empty for a non-empty order. Decisions are those of kvtier.routing.screen.
func Screen(order []string, versions map[string]string) []string {
	version, known := "", false
	for _, m := range order {
		if version, known = versions[m]; known {
			break
		}
	}
	if !known {
		return order
	}
	out := make([]string, 0, len(order))
	for _, m := range order {
		if v, ok := versions[m]; ok && v == version {
			out = append(out, m)
		}
	}
	return out
}

// walk is the rank of the first acceptable member: cool if it ranks above the
// sticky choice (stickyRank, -1 for none), merely not hot otherwise. If
// stickiness rules out everyone it is dropped; not every member can be above
// balanceFactor x the mean, so a member that is not hot exists.
func walk(order []string, g gate, stickyRank int) int {
	for rank, m := range order {
		if rank < stickyRank {
			if g.cool(m) {
				return rank
			}
		} else if !g.hot(m) {
			return rank
		}
	}
	for rank, m := range order {
		if !g.hot(m) {
			return rank
		}
	}
	return 0
}

// gate holds the hot / cool thresholds of one decision (one fleet mean).
type gate struct {
	occ                   map[string]float64
	spill, low            float64
	balanceHot, balanceLo float64
}

func (t *Table) gate(occupancy map[string]float64) gate {
	// Summed left to right in sorted member order, as kvtier.routing sums them.
	sum, n := 0.0, 0
	for _, m := range t.ranked.names {
		if v, ok := occupancy[m]; ok {
			sum += v
			n++
		}
	}
	mean := 0.0
	if n > 0 {
		mean = sum / float64(n)
	}
	// The conversions round each product before the subtraction: no fused multiply-add.
	balanceHot := float64(t.balanceFactor * mean)
	return gate{
		occ:        occupancy,
		spill:      t.spillOccupancy,
		low:        t.spillOccupancy - t.hysteresis,
		balanceHot: balanceHot,
		balanceLo:  balanceHot - t.hysteresis,
	}
}

func (g gate) hot(m string) bool {
	occ := g.occ[m]
	return occ > g.spill && occ > g.balanceHot
}

func (g gate) cool(m string) bool {
	occ := g.occ[m]
	return occ < g.low || occ < g.balanceLo
}
