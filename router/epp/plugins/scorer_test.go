package plugins

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvtier/kvtier/router/affinity"
	"github.com/kvtier/kvtier/router/affinity/vectors"
	"k8s.io/apimachinery/pkg/types"
	fwkdl "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/datalayer"
	fwksched "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/scheduling"
)

func loadPickVectors(t *testing.T) *vectors.File {
	t.Helper()
	v, err := vectors.Load("../../testdata/pick-vectors.json")
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// endpoint is a candidate as the EPP's datastore makes one: its pod's name,
// and metrics with an update time when the pod reported an occupancy.
func endpoint(pod string, occ float64, reported bool) fwksched.Endpoint {
	m := fwkdl.NewMetrics()
	if reported {
		m.KVCacheUsagePercent = occ
		m.UpdateTime = time.Now()
	}
	meta := &fwkdl.EndpointMetadata{
		NamespacedName: types.NamespacedName{Namespace: "ns", Name: pod},
		PodName:        pod, Address: "10.0.0.1", Port: "8000",
	}
	return fwksched.NewEndpoint(meta, m, nil)
}

func endpoints(members []string, occupancy map[string]float64) []fwksched.Endpoint {
	out := make([]fwksched.Endpoint, 0, len(members))
	for _, m := range members {
		occ, ok := occupancy[m]
		out = append(out, endpoint(m, occ, ok))
	}
	return out
}

func request(headers map[string]string) *fwksched.LLMRequest {
	return &fwksched.LLMRequest{RequestId: "r", TargetModel: "m", Headers: headers}
}

func tenantRequest(tenant string) *fwksched.LLMRequest {
	return request(map[string]string{"x-tenant-id": tenant})
}

func newScorer(t *testing.T, p AffinityParameters) *AffinityScorer {
	t.Helper()
	if p.CheckInterval == "" {
		p.CheckInterval = "0s" // every Score re-reads the file: the test controls when it changes
	}
	s, err := NewAffinityScorer(p)
	if err != nil {
		t.Fatalf("NewAffinityScorer: %v", err)
	}
	return s
}

func writeFile(t *testing.T, path, data string) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil { // as the kubelet swaps a ConfigMap volume: whole
		t.Fatal(err)
	}
}

// top is the single best-scored endpoint's pod, or "" with a tie at the top.
func top(t *testing.T, scores map[fwksched.Endpoint]float64) string {
	t.Helper()
	best, name, tie := -1.0, "", false
	for ep, sc := range scores {
		switch {
		case sc > best:
			best, name, tie = sc, MemberName(ep), false
		case sc == best:
			tie = true
		}
	}
	if tie {
		return ""
	}
	return name
}

func scoreOf(scores map[fwksched.Endpoint]float64, pod string) float64 {
	for ep, sc := range scores {
		if MemberName(ep) == pod {
			return sc
		}
	}
	return -1
}

// Every pick of the shared vectors, as the Python router makes it, is the
// scorer's top endpoint; the tenant's other homes score below it and above
// every non-home, which scores 0. Stateful sequences run through one scorer
// (its spill memory carries over, as the vectors' state does); stateless ones
// get a fresh scorer per step.
func TestScorerTopIsTheSharedVectorsPick(t *testing.T) {
	v := loadPickVectors(t)
	path := filepath.Join(t.TempDir(), "table.json")
	checked := 0
	for _, seq := range v.Sequences {
		t.Run(seq.Name, func(t *testing.T) {
			s := newScorer(t, AffinityParameters{TablePath: path})
			for i, step := range seq.Steps {
				if step.Error != "" || step.Pick == nil {
					continue // Pick refuses it and changes no state; the scorer's fallbacks are tested below
				}
				if !seq.Stateful {
					s = newScorer(t, AffinityParameters{TablePath: path})
				}
				tableJSON := v.Tables[step.Table].JSON
				writeFile(t, path, tableJSON)
				table, err := affinity.Decode([]byte(tableJSON))
				if err != nil {
					t.Fatal(err)
				}
				eps := labelled(table.Members(), step.Occupancy, step.Versions) // screened where the step has versions
				scores := s.Score(context.Background(), fwksched.NewCycleState(), tenantRequest(step.Tenant), eps)
				if got := top(t, scores); got != step.Pick.Member {
					t.Fatalf("step %d (tenant %q): top endpoint %q, the vectors pick %q (scores %v)",
						i, step.Tenant, got, step.Pick.Member, named(scores))
				}
				homes, _ := table.HomesFor(step.Tenant)
				for _, m := range table.Members() {
					sc := scoreOf(scores, m)
					switch {
					case m == step.Pick.Member:
					case contains(homes, m):
						if !(sc > 0 && sc < 1) {
							t.Fatalf("step %d: home %s scored %v, want in (0, 1)", i, m, sc)
						}
					default:
						if sc != 0 {
							t.Fatalf("step %d: non-home %s scored %v, want 0", i, m, sc)
						}
					}
				}
				checked++
			}
		})
	}
	if checked < 40 {
		t.Fatalf("only %d vector steps checked; the vectors shrank?", checked)
	}
}

func named(scores map[fwksched.Endpoint]float64) map[string]float64 {
	out := map[string]float64{}
	for ep, sc := range scores {
		out[MemberName(ep)] = sc
	}
	return out
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

func table3(epoch int, acmeHome string) string {
	b, _ := json.Marshal(map[string]any{
		"epoch": epoch, "members": map[string]float64{"pod-a": 1, "pod-b": 1, "pod-c": 1},
		"homes": 1, "homeOverrides": map[string][]string{"acme": {acmeHome}},
	})
	return string(b)
}

func pods3() []fwksched.Endpoint { return endpoints([]string{"pod-a", "pod-b", "pod-c"}, nil) }

func TestScorerFollowsTheFileWhenItChanges(t *testing.T) {
	path := filepath.Join(t.TempDir(), "table.json")
	writeFile(t, path, table3(1, "pod-a"))
	s := newScorer(t, AffinityParameters{TablePath: path})
	if got := top(t, s.Score(context.Background(), nil, tenantRequest("acme"), pods3())); got != "pod-a" {
		t.Fatalf("epoch 1: acme went to %q, its home is pod-a", got)
	}
	writeFile(t, path, table3(2, "pod-c"))
	if got := top(t, s.Score(context.Background(), nil, tenantRequest("acme"), pods3())); got != "pod-c" {
		t.Fatalf("epoch 2: acme went to %q, its new home is pod-c", got)
	}
	// An operator that starts its epochs over is followed too: the file is the record.
	writeFile(t, path, table3(0, "pod-b"))
	if got := top(t, s.Score(context.Background(), nil, tenantRequest("acme"), pods3())); got != "pod-b" {
		t.Fatalf("epoch 0 after 2: acme went to %q, the file's home is pod-b", got)
	}
}

func TestScorerReReadsOnlyEveryCheckInterval(t *testing.T) {
	path := filepath.Join(t.TempDir(), "table.json")
	writeFile(t, path, table3(1, "pod-a"))
	s := newScorer(t, AffinityParameters{TablePath: path, CheckInterval: "1h"})
	s.Score(context.Background(), nil, tenantRequest("acme"), pods3())
	writeFile(t, path, table3(2, "pod-c"))
	if got := top(t, s.Score(context.Background(), nil, tenantRequest("acme"), pods3())); got != "pod-a" {
		t.Fatalf("within the check interval acme went to %q; the file should not have been re-read yet", got)
	}
}

func TestScorerKeepsTheLastGoodTable(t *testing.T) {
	path := filepath.Join(t.TempDir(), "table.json")
	writeFile(t, path, table3(3, "pod-b"))
	s := newScorer(t, AffinityParameters{TablePath: path})
	if got := top(t, s.Score(context.Background(), nil, tenantRequest("acme"), pods3())); got != "pod-b" {
		t.Fatalf("good table: acme went to %q, want pod-b", got)
	}
	for _, bad := range []string{
		`{"epoch": 4, "members": {"pod-a": -1}}`, // fails the schema's rules
		`{"epoch": 4, "members": `,               // torn
		`{"epoch": 4, "members": {"pod-a": 1}, "surprise": true}`,
	} {
		writeFile(t, path, bad)
		if got := top(t, s.Score(context.Background(), nil, tenantRequest("acme"), pods3())); got != "pod-b" {
			t.Fatalf("after bad table %s: acme went to %q, want pod-b from the last good table", bad, got)
		}
		if s.source.LastError() == "" {
			t.Fatalf("bad table %s was not reported", bad)
		}
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if got := top(t, s.Score(context.Background(), nil, tenantRequest("acme"), pods3())); got != "pod-b" {
		t.Fatalf("file gone: acme went to %q, want pod-b from the last good table", got)
	}
	writeFile(t, path, table3(5, "pod-a"))
	if got := top(t, s.Score(context.Background(), nil, tenantRequest("acme"), pods3())); got != "pod-a" {
		t.Fatalf("good table back: acme went to %q, want pod-a", got)
	}
	if e := s.source.LastError(); e != "" {
		t.Fatalf("a good read left the error %q", e)
	}
}

// With no table ever read, the candidates are the table: plain rendezvous,
// one top endpoint, the same for every call, and a tenant's own.
func TestScorerWithoutATableIsPlainRendezvous(t *testing.T) {
	s := newScorer(t, AffinityParameters{TablePath: filepath.Join(t.TempDir(), "missing.json")})
	pods := []string{"pod-a", "pod-b", "pod-c", "pod-d", "pod-e"}
	members := map[string]float64{}
	for _, p := range pods {
		members[p] = 1
	}
	data, _ := json.Marshal(map[string]any{"members": members})
	plain, err := affinity.Decode(data)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for i := 0; i < 40; i++ {
		tenant := "tenant-" + string(rune('A'+i))
		order, _ := plain.OrderFor(tenant)
		for rep := 0; rep < 2; rep++ {
			if got := top(t, s.Score(context.Background(), nil, tenantRequest(tenant), endpoints(pods, nil))); got != order[0] {
				t.Fatalf("no table: %s went to %q, plain rendezvous says %q", tenant, got, order[0])
			}
		}
		seen[order[0]] = true
	}
	if len(seen) < 3 {
		t.Fatalf("40 tenants landed on only %d of 5 pods: not spread by tenant", len(seen))
	}
}

// A table that names none of the candidates (another pool's) routes like no table.
func TestScorerIgnoresATableOfOtherPods(t *testing.T) {
	path := filepath.Join(t.TempDir(), "table.json")
	writeFile(t, path, table3(1, "pod-a"))
	s := newScorer(t, AffinityParameters{TablePath: path})
	scores := s.Score(context.Background(), nil, tenantRequest("acme"), endpoints([]string{"x-0", "x-1"}, nil))
	if got := top(t, scores); got != "x-0" && got != "x-1" {
		t.Fatalf("top %q over candidates x-0, x-1 (scores %v)", got, named(scores))
	}
}

func TestScorerStandsInWhenThePickIsNoCandidate(t *testing.T) {
	path := filepath.Join(t.TempDir(), "table.json")
	writeFile(t, path, table3(1, "pod-a"))
	s := newScorer(t, AffinityParameters{TablePath: path})
	table, _ := affinity.Decode([]byte(table3(1, "pod-a")))
	order, _ := table.OrderFor("acme") // pod-a first, then the rest in rendezvous order
	eps := endpoints([]string{"pod-b", "pod-c"}, nil)
	if got := top(t, s.Score(context.Background(), nil, tenantRequest("acme"), eps)); got != order[1] {
		t.Fatalf("pod-a gone: acme went to %q, the next in its order is %q", got, order[1])
	}
}

func TestScorerDefaultTenantForAMissingOrBadHeader(t *testing.T) {
	path := filepath.Join(t.TempDir(), "table.json")
	b, _ := json.Marshal(map[string]any{
		"epoch": 1, "members": map[string]float64{"pod-a": 1, "pod-b": 1, "pod-c": 1}, "homes": 1,
		"homeOverrides": map[string][]string{"default": {"pod-c"}, "anon": {"pod-b"}, "acme": {"pod-a"}},
	})
	writeFile(t, path, string(b))
	s := newScorer(t, AffinityParameters{TablePath: path})
	cases := map[string]*fwksched.LLMRequest{
		"no headers":    request(nil),
		"other header":  request(map[string]string{"x-user": "acme"}),
		"empty tenant":  tenantRequest(""),
		"blank tenant":  tenantRequest("   "),
		"invalid UTF-8": tenantRequest("\xff\xfe"),
		"nil request":   nil,
	}
	for name, req := range cases {
		if got := top(t, s.Score(context.Background(), nil, req, pods3())); got != "pod-c" {
			t.Fatalf("%s: went to %q, the default tenant's home is pod-c", name, got)
		}
	}
	if got := top(t, s.Score(context.Background(), nil, request(map[string]string{"X-Tenant-Id": "acme"}), pods3())); got != "pod-a" {
		t.Fatalf("header names match case-insensitively: went to %q, want pod-a", got)
	}
	// A configured header and default tenant.
	s2 := newScorer(t, AffinityParameters{TablePath: path, TenantHeader: "X-Org", DefaultTenant: "anon"})
	if got := top(t, s2.Score(context.Background(), nil, request(map[string]string{"x-org": "acme"}), pods3())); got != "pod-a" {
		t.Fatalf("configured header: went to %q, want pod-a", got)
	}
	if got := top(t, s2.Score(context.Background(), nil, tenantRequest("acme"), pods3())); got != "pod-b" {
		t.Fatalf("configured default tenant: went to %q, want pod-b", got)
	}
}

func TestScorerEmptyCandidates(t *testing.T) {
	s := newScorer(t, AffinityParameters{})
	if got := s.Score(context.Background(), nil, tenantRequest("acme"), nil); len(got) != 0 {
		t.Fatalf("scores for no candidates: %v", got)
	}
}

func TestFactoryRefusesBadParameters(t *testing.T) {
	for _, raw := range []string{
		`{"tablePath": 3}`,
		`{"unknown": "x"}`,
		`{"checkInterval": "soon"}`,
		`{"redisUrl": "redis://localhost:6379"}`,
		`{"redisUrl": "http://localhost", "redisKey": "k"}`,
	} {
		if _, err := AffinityScorerFactory("s", json.RawMessage(raw), nil); err == nil {
			t.Fatalf("parameters %s accepted", raw)
		}
	}
	p, err := AffinityScorerFactory("mine", json.RawMessage(`{"tablePath": "/x", "tenantHeader": "x-org"}`), nil)
	if err != nil {
		t.Fatal(err)
	}
	if tn := p.TypedName(); tn.Type != AffinityScorerType || tn.Name != "mine" {
		t.Fatalf("typed name %v", tn)
	}
}
