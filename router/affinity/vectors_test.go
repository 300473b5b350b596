package affinity

import (
	"math"
	"reflect"
	"testing"

	"github.com/kvtier/kvtier/router/affinity/vectors"
)

func loadVectors(t *testing.T) (*vectors.File, map[string]*Table) {
	t.Helper()
	v, err := vectors.Load("../testdata/pick-vectors.json")
	if err != nil {
		t.Fatal(err)
	}
	tables := map[string]*Table{}
	for name, tb := range v.Tables {
		table, err := Decode([]byte(tb.JSON))
		if err != nil {
			t.Fatalf("table %s: %v", name, err)
		}
		tables[name] = table
	}
	return v, tables
}

func TestVectorsNameThisRendezvousVersion(t *testing.T) {
	v, _ := loadVectors(t)
	if v.RendezvousVersion != RendezvousVersion {
		t.Fatalf("vectors are for rendezvous version %d, this package implements %d", v.RendezvousVersion, RendezvousVersion)
	}
}

func TestHashesMatchPython(t *testing.T) {
	v, _ := loadVectors(t)
	if len(v.Hashes) == 0 {
		t.Fatal("no hash vectors")
	}
	for name, h := range v.Hashes {
		if got := TenantHash(name); got != h.TenantHash {
			t.Errorf("TenantHash(%q) = %#x, want %#x", name, got, h.TenantHash)
		}
		if got := MemberHash(name); got != h.MemberHash {
			t.Errorf("MemberHash(%q) = %#x, want %#x", name, got, h.MemberHash)
		}
	}
}

func TestOrdersHomesAndScoresMatchPython(t *testing.T) {
	v, tables := loadVectors(t)
	if len(v.Orders) == 0 {
		t.Fatal("no order vectors")
	}
	for _, o := range v.Orders {
		table := tables[o.Table]
		order, err := table.OrderFor(o.Tenant)
		if err != nil {
			t.Fatalf("%s/%q: %v", o.Table, o.Tenant, err)
		}
		if !equalNames(order, o.Order) {
			t.Errorf("%s/%q: order %q, want %q", o.Table, o.Tenant, order, o.Order)
		}
		homes, err := table.HomesFor(o.Tenant)
		if err != nil || !equalNames(homes, o.Homes) {
			t.Errorf("%s/%q: homes %q (%v), want %q", o.Table, o.Tenant, homes, err, o.Homes)
		}
		th := TenantHash(o.Tenant)
		for i, m := range o.Order {
			w, _ := table.Weight(m)
			got, want := Score(th, MemberHash(m), w), o.Scores[i]
			if math.Abs(got-want) > 1e-12*math.Abs(want) {
				t.Errorf("%s/%q: score of %q = %v, want %v", o.Table, o.Tenant, m, got, want)
			}
		}
	}
}

func TestPickSequencesMatchPython(t *testing.T) {
	v, tables := loadVectors(t)
	if len(v.Sequences) == 0 {
		t.Fatal("no pick sequences")
	}
	for _, seq := range v.Sequences {
		t.Run(seq.Name, func(t *testing.T) {
			var state *SpillState
			if seq.Stateful {
				state = NewSpillState()
			}
			for i, step := range seq.Steps {
				got, err := tables[step.Table].PickVersioned(step.Tenant, step.Occupancy, state, step.Versions)
				switch {
				case step.Pick == nil && err == nil:
					t.Fatalf("step %d: picked %+v, want the error %q", i, got, step.Error)
				case step.Pick != nil && err != nil:
					t.Fatalf("step %d: %v, want %+v", i, err, *step.Pick)
				case step.Pick != nil:
					want := Pick{Member: step.Pick.Member, Rank: step.Pick.Rank, Spilled: step.Pick.Spilled, Epoch: step.Pick.Epoch}
					if got != want {
						t.Errorf("step %d (%s, %q): pick %+v, want %+v", i, step.Table, step.Tenant, got, want)
					}
				}
				if step.SpillState == nil {
					continue
				}
				if state.Epoch() != step.SpillState.Epoch {
					t.Errorf("step %d: state epoch %d, want %d", i, state.Epoch(), step.SpillState.Epoch)
				}
				if moved := state.MovedTo(); !reflect.DeepEqual(moved, step.SpillState.MovedTo) {
					t.Errorf("step %d: moved %v, want %v", i, moved, step.SpillState.MovedTo)
				}
			}
		})
	}
}

func TestScreensMatchPython(t *testing.T) {
	v, _ := loadVectors(t)
	if len(v.Screens) < 5 {
		t.Fatalf("only %d screen vectors", len(v.Screens))
	}
	screened := 0
	for _, s := range v.Sequences {
		for _, step := range s.Steps {
			if step.Versions != nil {
				screened++
			}
		}
	}
	if screened < 10 {
		t.Fatalf("only %d screened pick steps; the vectors shrank?", screened)
	}
	for _, s := range v.Screens {
		if got := Screen(s.Order, s.Versions); !equalNames(got, s.Screened) {
			t.Errorf("%s: Screen(%q, %v) = %q, want %q", s.Name, s.Order, s.Versions, got, s.Screened)
		}
	}
}

func TestInvalidTablesAreRefused(t *testing.T) {
	v, _ := loadVectors(t)
	if len(v.InvalidTables) == 0 {
		t.Fatal("no invalid tables")
	}
	for _, bad := range v.InvalidTables {
		if table, err := Decode([]byte(bad.JSON)); err == nil {
			t.Errorf("%s (%s): decoded %+v, want a refusal", bad.Name, bad.Rule, table)
		}
	}
}

func equalNames(a, b []string) bool {
	if len(a) == 0 && len(b) == 0 {
		return true
	}
	return reflect.DeepEqual(a, b)
}
