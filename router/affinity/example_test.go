package affinity_test

import (
	"fmt"

	"github.com/kvtier/kvtier/router/affinity"
)

// A router decodes the published table once per epoch and keeps one SpillState
// across tables; each request is one Pick.
func ExampleTable_Pick() {
	table, err := affinity.Decode([]byte(`{"epoch":4,"members":{"pod-0":1,"pod-1":1,"pod-2":1},"homes":2}`))
	if err != nil {
		panic(err)
	}
	state := affinity.NewSpillState()
	homes, _ := table.HomesFor("tenant-a")
	cool, _ := table.Pick("tenant-a", map[string]float64{"pod-0": 0.3, "pod-1": 0.3, "pod-2": 0.3}, state)
	hot, _ := table.Pick("tenant-a", map[string]float64{homes[0]: 0.95, homes[1]: 0.2}, state)
	fmt.Println(cool.Member == homes[0], cool.Rank, cool.Spilled)
	fmt.Println(hot.Member == homes[1], hot.Rank, hot.Spilled, state.MovedTo()["tenant-a"] == homes[1])
	// Output:
	// true 0 false
	// true 1 false true
}
