package affinity

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"unicode/utf8"
)

// Defaults of the table's optional fields, as the schema gives them
// (router/schema/affinity-table.schema.json; a test keeps the two equal).
const (
	DefaultHomes          = 3
	DefaultSpillOccupancy = 0.85
	DefaultBalanceFactor  = 1.25
	DefaultHysteresis     = 0.05
	maxHomes              = 64
	maxBalanceFactor      = 100.0
)

// ErrInvalidTable wraps every reason Decode refuses a table.
var ErrInvalidTable = errors.New("invalid affinity table")

// Table is one epoch of tenant affinity as the operator publishes it: members
// and their weights, k homes per tenant, the spill knobs and the overrides for
// tenants whose homes bounded loads moved off plain rendezvous.
//
// A Table is immutable and safe for concurrent use; a new epoch is a new Table.
// Decode is the only way to make one, so every Table has passed the schema's
// rules: weights finite and > 0, 1 <= homes <= 64, 0 < spillOccupancy <= 1,
// 1 <= balanceFactor <= 100, 0 <= hysteresis < spillOccupancy, and every
// override naming min(homes, members) distinct members.
type Table struct {
	epoch          int64
	members        map[string]float64
	homes          int
	spillOccupancy float64
	balanceFactor  float64
	hysteresis     float64
	overrides      map[string][]string
	ranked         ranked
}

// wireTable is the JSON form; pointers tell an absent field (default) from a present one.
type wireTable struct {
	RendezvousVersion *int                `json:"rendezvousVersion"`
	Epoch             *int64              `json:"epoch"`
	Members           map[string]float64  `json:"members"`
	Homes             *int                `json:"homes"`
	SpillOccupancy    *float64            `json:"spillOccupancy"`
	BalanceFactor     *float64            `json:"balanceFactor"`
	Hysteresis        *float64            `json:"hysteresis"`
	HomeOverrides     map[string][]string `json:"homeOverrides"`
}

var wireFields = map[string]bool{
	"rendezvousVersion": true, "epoch": true, "members": true, "homes": true,
	"spillOccupancy": true, "balanceFactor": true, "hysteresis": true, "homeOverrides": true,
}

// Decode reads a table's wire form strictly: camelCase keys only (matched
// exactly), no unknown fields, no nulls, JSON numbers for numbers, valid UTF-8,
// then the schema's rules. Every refusal wraps ErrInvalidTable.
func Decode(data []byte) (*Table, error) {
	if err := checkShape(data); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalidTable, err)
	}
	var w wireTable
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&w); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalidTable, err)
	}
	t, err := fromWire(&w)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalidTable, err)
	}
	return t, nil
}

// checkShape refuses what encoding/json would otherwise let through: a
// non-object, keys that match a field only case-insensitively, nulls, invalid
// UTF-8 (which it would replace rather than refuse), trailing data.
func checkShape(data []byte) error {
	if !utf8.Valid(data) {
		return errors.New("not valid UTF-8")
	}
	if err := checkEscapes(data); err != nil {
		return err
	}
	var top map[string]json.RawMessage
	if err := json.Unmarshal(data, &top); err != nil {
		return fmt.Errorf("not a JSON object: %v", err)
	}
	for key := range top {
		if !wireFields[key] {
			return fmt.Errorf("unknown field %q", key)
		}
	}
	var any interface{}
	if err := json.Unmarshal(data, &any); err != nil {
		return err
	}
	return noNulls(any, "$")
}

func noNulls(v interface{}, path string) error {
	switch x := v.(type) {
	case nil:
		return fmt.Errorf("%s is null", path)
	case map[string]interface{}:
		for k, e := range x {
			if err := noNulls(e, path+"."+k); err != nil {
				return err
			}
		}
	case []interface{}:
		for i, e := range x {
			if err := noNulls(e, fmt.Sprintf("%s[%d]", path, i)); err != nil {
				return err
			}
		}
	}
	return nil
}

func fromWire(w *wireTable) (*Table, error) {
	t := &Table{
		homes: DefaultHomes, spillOccupancy: DefaultSpillOccupancy,
		balanceFactor: DefaultBalanceFactor, hysteresis: DefaultHysteresis,
		members: map[string]float64{}, overrides: map[string][]string{},
	}
	if w.RendezvousVersion != nil && *w.RendezvousVersion != RendezvousVersion {
		return nil, fmt.Errorf("rendezvousVersion %d, this reader knows %d: upgrade the reader before routing with it",
			*w.RendezvousVersion, RendezvousVersion)
	}
	if w.Epoch != nil {
		t.epoch = *w.Epoch
	}
	if w.Homes != nil {
		t.homes = *w.Homes
	}
	if w.SpillOccupancy != nil {
		t.spillOccupancy = *w.SpillOccupancy
	}
	if w.BalanceFactor != nil {
		t.balanceFactor = *w.BalanceFactor
	}
	if w.Hysteresis != nil {
		t.hysteresis = *w.Hysteresis
	}
	switch {
	case t.epoch < 0:
		return nil, fmt.Errorf("epoch %d must be >= 0", t.epoch)
	case t.homes < 1 || t.homes > maxHomes:
		return nil, fmt.Errorf("homes %d must be in [1, %d]", t.homes, maxHomes)
	case !(t.spillOccupancy > 0 && t.spillOccupancy <= 1):
		return nil, fmt.Errorf("spillOccupancy %v must be in (0, 1]", t.spillOccupancy)
	case !(t.balanceFactor >= 1 && t.balanceFactor <= maxBalanceFactor):
		return nil, fmt.Errorf("balanceFactor %v must be in [1, %v]", t.balanceFactor, maxBalanceFactor)
	case !(t.hysteresis >= 0 && t.hysteresis < 1):
		return nil, fmt.Errorf("hysteresis %v must be in [0, 1)", t.hysteresis)
	case t.hysteresis >= t.spillOccupancy:
		return nil, fmt.Errorf("hysteresis %v must be below spillOccupancy %v: a spilled tenant could never return",
			t.hysteresis, t.spillOccupancy)
	}
	for name, weight := range w.Members {
		if name == "" {
			return nil, errors.New("member names must be non-empty")
		}
		if math.IsNaN(weight) || math.IsInf(weight, 0) || weight <= 0 {
			return nil, fmt.Errorf("member %q has weight %v; weights must be finite and > 0", name, weight)
		}
		t.members[name] = weight
	}
	if err := t.setOverrides(w.HomeOverrides); err != nil {
		return nil, err
	}
	t.ranked = rankMembers(t.members)
	return t, nil
}

func (t *Table) setOverrides(overrides map[string][]string) error {
	want := min(t.homes, len(t.members))
	for tenant, homes := range overrides {
		if tenant == "" {
			return errors.New("homeOverrides: tenant names must be non-empty")
		}
		seen := make(map[string]bool, len(homes))
		for _, m := range homes {
			if _, ok := t.members[m]; ok && !seen[m] {
				seen[m] = true
			}
		}
		if len(homes) != want || len(seen) != want {
			return fmt.Errorf("homeOverrides[%q] = %q: must name %d distinct members of this table", tenant, homes, want)
		}
		t.overrides[tenant] = append([]string(nil), homes...)
	}
	return nil
}

// Epoch of this table; routers follow the newest they have read.
func (t *Table) Epoch() int64 { return t.epoch }

// Homes is k, the homes per tenant.
func (t *Table) Homes() int { return t.homes }

// Members are the member names in sorted order (a copy).
func (t *Table) Members() []string { return append([]string(nil), t.ranked.names...) }

// Weight of a member, and whether it is one.
func (t *Table) Weight(member string) (float64, bool) {
	w, ok := t.members[member]
	return w, ok
}

// checkEscapes refuses a \u escape of half a surrogate pair, which encoding/json
// would turn into U+FFFD: the name would then hash differently from the one the
// writer meant (Python's readers refuse such a table too).
func checkEscapes(data []byte) error {
	inString := false
	for i := 0; i < len(data); i++ {
		switch c := data[i]; {
		case c == '"':
			inString = !inString
		case c == '\\' && inString:
			if i+1 < len(data) && data[i+1] == 'u' {
				r, ok := hex4(data, i+2)
				switch {
				case ok && r >= 0xD800 && r < 0xDC00:
					low, okLow := rune(0), i+7 < len(data) && data[i+6] == '\\' && data[i+7] == 'u'
					if okLow {
						low, okLow = hex4(data, i+8)
					}
					if !okLow || low < 0xDC00 || low >= 0xE000 {
						return fmt.Errorf("lone surrogate escape at byte %d", i)
					}
					i += 11
					continue
				case ok && r >= 0xDC00 && r < 0xE000:
					return fmt.Errorf("lone surrogate escape at byte %d", i)
				}
			}
			i++ // skip the escaped character
		}
	}
	return nil
}

func hex4(data []byte, at int) (rune, bool) {
	if at+4 > len(data) {
		return 0, false
	}
	var r rune
	for _, c := range data[at : at+4] {
		switch {
		case c >= '0' && c <= '9':
			r = r<<4 | rune(c-'0')
		case c >= 'a' && c <= 'f':
			r = r<<4 | rune(c-'a'+10)
		case c >= 'A' && c <= 'F':
			r = r<<4 | rune(c-'A'+10)
		default:
			return 0, false
		}
	}
	return r, true
}
