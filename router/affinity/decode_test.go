package affinity

import (
	"errors"
	"testing"
)

// What encoding/json alone would accept and the wire contract does not.
func TestDecodeIsStricterThanEncodingJSON(t *testing.T) {
	for name, text := range map[string]string{
		"field matched only case-insensitively": `{"Epoch":1}`,
		"snake_case name":                       `{"spill_occupancy":0.5}`,
		"null member weight":                    `{"members":{"a":null}}`,
		"null override":                         `{"homeOverrides":{"t":null}}`,
		"number as a string":                    `{"members":{"a":"1.5"}}`,
		"boolean as a number":                   `{"homes":true}`,
		"invalid UTF-8 in a name":               "{\"members\":{\"a\xff\":1}}",
		"lone surrogate escape":                 `{"members":{"\ud800":1}}`,
		"lone low surrogate escape":             `{"members":{"a\udc00":1}}`,
		"high surrogate then a letter":          `{"members":{"\ud800\u0041":1}}`,
		"trailing data":                         `{"epoch":1} {"epoch":2}`,
		"epoch beyond int64":                    `{"epoch":99999999999999999999}`,
	} {
		if _, err := Decode([]byte(text)); !errors.Is(err, ErrInvalidTable) {
			t.Errorf("%s: %s decoded (err %v), want ErrInvalidTable", name, text, err)
		}
	}
}

func TestPickRefusesNamesOtherReadersCannotHash(t *testing.T) {
	table, err := Decode([]byte(`{"members":{"a":1,"b":1}}`))
	if err != nil {
		t.Fatal(err)
	}
	state := NewSpillState()
	for _, tenant := range []string{"", "bad\xffutf8"} {
		if _, err := table.Pick(tenant, nil, state); !errors.Is(err, ErrBadTenant) {
			t.Errorf("Pick(%q) = %v, want ErrBadTenant", tenant, err)
		}
	}
	if state.Epoch() != -1 {
		t.Errorf("a refused pick moved the state to epoch %d", state.Epoch())
	}
}

func TestOverridesAreCopiedNotShared(t *testing.T) {
	table, err := Decode([]byte(`{"members":{"a":1,"b":1},"homes":1,"homeOverrides":{"t":["b"]}}`))
	if err != nil {
		t.Fatal(err)
	}
	homes, _ := table.HomesFor("t")
	homes[0] = "a"
	if again, _ := table.HomesFor("t"); again[0] != "b" {
		t.Fatalf("a caller's write changed the table's override: %q", again)
	}
}

func TestSurrogatePairsDecodeToTheirCharacter(t *testing.T) {
	table, err := Decode([]byte(`{"members":{"\ud83e\udd99-llama":1,"a\\\"b":1}}`))
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := table.Weight("🦙-llama"); !ok {
		t.Fatalf("members %q, want the llama", table.Members())
	}
	if _, ok := table.Weight(`a\"b`); !ok {
		t.Fatalf("members %q, want an escaped backslash and quote kept", table.Members())
	}
}
