package affinity

import (
	"fmt"
	"sync"
	"testing"
)

// Concurrent picks sharing one SpillState agree with the same picks made one by one.
func TestConcurrentPicksShareOneState(t *testing.T) {
	table, err := Decode([]byte(`{"epoch":1,"members":{"a":1,"b":1,"c":1,"d":1},"homes":2}`))
	if err != nil {
		t.Fatal(err)
	}
	tenants := make([]string, 64)
	for i := range tenants {
		tenants[i] = fmt.Sprintf("tenant-%d", i)
	}
	occupancy := func(tenant string) map[string]float64 {
		homes, _ := table.HomesFor(tenant)
		occ := map[string]float64{"a": 0.1, "b": 0.1, "c": 0.1, "d": 0.1}
		occ[homes[0]] = 0.95 // every tenant moves to its second home
		return occ
	}
	want := map[string]Pick{}
	serial := NewSpillState()
	for _, tn := range tenants {
		want[tn], _ = table.Pick(tn, occupancy(tn), serial)
	}
	shared := NewSpillState()
	var wg sync.WaitGroup
	got := make([]Pick, len(tenants))
	for i, tn := range tenants {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[i], _ = table.Pick(tn, occupancy(tn), shared)
		}()
	}
	wg.Wait()
	for i, tn := range tenants {
		if got[i] != want[tn] {
			t.Errorf("%s: concurrent pick %+v, serial %+v", tn, got[i], want[tn])
		}
	}
	if len(serial.MovedTo()) != len(tenants) {
		t.Fatalf("%d of %d tenants moved: the occupancy no longer spills them", len(serial.MovedTo()), len(tenants))
	}
	if fmt.Sprint(shared.MovedTo()) != fmt.Sprint(serial.MovedTo()) {
		t.Errorf("shared state %v, serial %v", shared.MovedTo(), serial.MovedTo())
	}
}
