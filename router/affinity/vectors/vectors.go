// Package vectors reads the shared test vectors that kvtier's Python side
// generates (`kvtier contract`: router/testdata/pick-vectors.json) and that the Go
// implementations of its affinity decisions are tested against: one definition of
// the file's shape for every Go test that reads it.
package vectors

import (
	"encoding/json"
	"fmt"
	"os"
)

// File is the shared vectors' JSON (router/testdata/pick-vectors.json).
type File struct {
	RendezvousVersion int `json:"rendezvousVersion"`
	Hashes            map[string]struct {
		TenantHash uint64 `json:"tenantHash"`
		MemberHash uint64 `json:"memberHash"`
	} `json:"hashes"`
	Tables map[string]struct {
		JSON string `json:"json"`
	} `json:"tables"`
	InvalidTables []struct {
		Name string `json:"name"`
		JSON string `json:"json"`
		Rule string `json:"rule"`
	} `json:"invalidTables"`
	Orders []struct {
		Table  string    `json:"table"`
		Tenant string    `json:"tenant"`
		Order  []string  `json:"order"`
		Scores []float64 `json:"scores"`
		Homes  []string  `json:"homes"`
	} `json:"orders"`
	Sequences []struct {
		Name     string `json:"name"`
		Stateful bool   `json:"stateful"`
		Steps    []struct {
			Table     string             `json:"table"`
			Tenant    string             `json:"tenant"`
			Occupancy map[string]float64 `json:"occupancy"`
			// Versions screens the step (member -> weights version); nil: unscreened.
			Versions map[string]string `json:"versions"`
			Pick     *struct {
				Member  string `json:"member"`
				Rank    int    `json:"rank"`
				Spilled bool   `json:"spilled"`
				Epoch   int64  `json:"epoch"`
			} `json:"pick"`
			Error      string `json:"error"`
			SpillState *struct {
				Epoch   int64             `json:"epoch"`
				MovedTo map[string]string `json:"movedTo"`
			} `json:"spillState"`
		} `json:"steps"`
	} `json:"sequences"`
	// Screens are the version screen on its own (kvtier.routing.screen).
	Screens []struct {
		Name     string            `json:"name"`
		Order    []string          `json:"order"`
		Versions map[string]string `json:"versions"`
		Screened []string          `json:"screened"`
	} `json:"screens"`
}

// Load reads and decodes the vectors at path.
func Load(path string) (*File, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read the shared vectors (run `kvtier contract`): %w", err)
	}
	var v File
	if err := json.Unmarshal(data, &v); err != nil {
		return nil, fmt.Errorf("decode the shared vectors: %w", err)
	}
	return &v, nil
}
