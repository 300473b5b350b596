package affinity

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"testing"
)

// The committed schema (written by `kvtier contract` from kvtier/affinity.py).
type schemaProp struct {
	Type             string   `json:"type"`
	Default          any      `json:"default"`
	Const            *float64 `json:"const"`
	Minimum          *float64 `json:"minimum"`
	Maximum          *float64 `json:"maximum"`
	ExclusiveMinimum *float64 `json:"exclusiveMinimum"`
	ExclusiveMaximum *float64 `json:"exclusiveMaximum"`
	// For a map property: the schema of its values (members' weights).
	AdditionalProperties *schemaProp `json:"additionalProperties"`
}

func loadSchema(t *testing.T) map[string]schemaProp {
	t.Helper()
	data, err := os.ReadFile("../schema/affinity-table.schema.json")
	if err != nil {
		t.Fatalf("read the schema (run `kvtier contract`): %v", err)
	}
	var s struct {
		AdditionalProperties bool                  `json:"additionalProperties"`
		Properties           map[string]schemaProp `json:"properties"`
	}
	if err := json.Unmarshal(data, &s); err != nil {
		t.Fatalf("decode the schema: %v", err)
	}
	if s.AdditionalProperties {
		t.Fatal("the schema allows unknown fields; Decode refuses them")
	}
	return s.Properties
}

func TestDecodeKnowsExactlyTheSchemasFields(t *testing.T) {
	props := loadSchema(t)
	var inSchema, inDecode []string
	for name := range props {
		inSchema = append(inSchema, name)
	}
	for name := range wireFields {
		inDecode = append(inDecode, name)
	}
	sort.Strings(inSchema)
	sort.Strings(inDecode)
	if fmt.Sprint(inSchema) != fmt.Sprint(inDecode) {
		t.Fatalf("schema fields %v, Decode fields %v", inSchema, inDecode)
	}
}

func TestDefaultsAreTheSchemas(t *testing.T) {
	props := loadSchema(t)
	table, err := Decode([]byte("{}"))
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{
		"rendezvousVersion": RendezvousVersion, "epoch": float64(table.epoch), "homes": float64(table.homes),
		"spillOccupancy": table.spillOccupancy, "balanceFactor": table.balanceFactor, "hysteresis": table.hysteresis,
	}
	for name, value := range got {
		if want, ok := props[name].Default.(float64); !ok || want != value {
			t.Errorf("default %s = %v, schema says %v", name, value, props[name].Default)
		}
	}
	if len(table.members) != 0 || len(table.overrides) != 0 {
		t.Errorf("an empty table has members %v, overrides %v", table.members, table.overrides)
	}
}

// Every numeric bound of the schema, probed at the bound and just past it.
func TestDecodeEnforcesTheSchemasBounds(t *testing.T) {
	props := loadSchema(t)
	// Fields the cross-field rule (hysteresis < spillOccupancy) would otherwise trip.
	base := map[string]string{"spillOccupancy": `"hysteresis":0,`, "hysteresis": `"spillOccupancy":1,`}
	probes := 0
	for name, prop := range props {
		p, format := prop, `{%s"%s":%v}`
		if p.AdditionalProperties != nil { // a map: probe one entry's value
			p, format = *p.AdditionalProperties, `{%s"%s":{"m":%v}}`
		}
		if p.Type != "integer" && p.Type != "number" {
			continue
		}
		step := 1e-9
		if p.Type == "integer" {
			step = 1
		}
		try := func(v float64, accept bool) {
			probes++
			text := fmt.Sprintf(format, base[name], name, v)
			_, err := Decode([]byte(text))
			if accept != (err == nil) {
				t.Errorf("%s: accepted=%v, want %v (%v)", text, err == nil, accept, err)
			}
		}
		if p.Const != nil {
			try(*p.Const, true)
			try(*p.Const+1, false)
		}
		if p.Minimum != nil {
			try(*p.Minimum, true)
			try(*p.Minimum-step, false)
		}
		if p.Maximum != nil {
			try(*p.Maximum, true)
			try(*p.Maximum+step, false)
		}
		if p.ExclusiveMinimum != nil {
			try(*p.ExclusiveMinimum, false)
			try(*p.ExclusiveMinimum+step, true)
		}
		if p.ExclusiveMaximum != nil {
			try(*p.ExclusiveMaximum, false)
			try(*p.ExclusiveMaximum-step, true)
		}
	}
	if probes < 16 {
		t.Fatalf("only %d probes: the schema lost its bounds", probes)
	}
}
