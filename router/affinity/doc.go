// Package affinity reads kvtier's affinity table and routes tenants the way
// kvtier.routing.pick does, so a Go router (an Endpoint Picker scorer or
// filter) and kvtier's Python readers send every tenant to the same replica.
//
// The contract has one definition, in kvtier/affinity.py: its wire form is
// exported as router/schema/affinity-table.schema.json, and the decisions of
// kvtier/routing.py and kvtier/rendezvous.py as router/testdata/pick-vectors.json;
// `kvtier contract` writes both and this package's tests assert every vector.
//
// Use:
//
//	table, err := affinity.Decode(configMapData["table.json"])
//	state := affinity.NewSpillState() // one per router, kept across tables
//	p, err := table.Pick(tenant, occupancy, state)
//
// The package holds no global state: a Table is immutable, and a SpillState
// is the only mutable thing, owned by its caller.
package affinity
