package plugins

import (
	"context"
	"encoding/json"
	"path/filepath"
	"sort"
	"testing"

	"github.com/kvtier/kvtier/router/affinity"
	fwksched "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/scheduling"
)

// labelled are the members' endpoints, each pod labelled with its version in
// versions (none for a member it does not name), reporting occupancy where given.
func labelled(members []string, occupancy map[string]float64, versions map[string]string) []fwksched.Endpoint {
	eps := endpoints(members, occupancy)
	for _, ep := range eps {
		if v, ok := versions[MemberName(ep)]; ok {
			ep.GetMetadata().Labels = map[string]string{DefaultVersionLabel: v}
		}
	}
	return eps
}

func newScreener(t *testing.T, p AffinityParameters) *VersionScreener {
	t.Helper()
	if p.CheckInterval == "" {
		p.CheckInterval = "0s"
	}
	s, err := NewVersionScreener(p)
	if err != nil {
		t.Fatalf("NewVersionScreener: %v", err)
	}
	return s
}

func podNames(eps []fwksched.Endpoint) []string {
	out := make([]string, 0, len(eps))
	for _, ep := range eps {
		out = append(out, MemberName(ep))
	}
	sort.Strings(out)
	return out
}

func ofVersion(versions map[string]string, version string) []string {
	var out []string
	for m, v := range versions {
		if v == version {
			out = append(out, m)
		}
	}
	sort.Strings(out)
	return out
}

// uniform8 is the vectors' eight-pod table, written where a plugin reads it.
func uniform8(t *testing.T) (string, *affinity.Table) {
	t.Helper()
	v := loadPickVectors(t)
	path := filepath.Join(t.TempDir(), "table.json")
	writeFile(t, path, v.Tables["uniform8"].JSON)
	table, err := affinity.Decode([]byte(v.Tables["uniform8"].JSON))
	if err != nil {
		t.Fatal(err)
	}
	return path, table
}

// Every screened step of the shared vectors: the screener keeps exactly the
// candidates of the picked member's version, and the scorer (which walks the
// same screened order) puts the vectors' pick on top, over the screened
// candidates as over all of them.
func TestScreenerAndScorerFollowTheSharedVectors(t *testing.T) {
	v := loadPickVectors(t)
	path := filepath.Join(t.TempDir(), "table.json")
	checked := 0
	for _, seq := range v.Sequences {
		t.Run(seq.Name, func(t *testing.T) {
			s := newScorer(t, AffinityParameters{TablePath: path})
			f := newScreener(t, AffinityParameters{TablePath: path})
			for i, step := range seq.Steps {
				if step.Versions == nil || step.Pick == nil {
					continue
				}
				if !seq.Stateful {
					s = newScorer(t, AffinityParameters{TablePath: path})
				}
				writeFile(t, path, v.Tables[step.Table].JSON)
				table, _ := affinity.Decode([]byte(v.Tables[step.Table].JSON))
				eps := labelled(table.Members(), step.Occupancy, step.Versions)
				kept := f.Filter(context.Background(), fwksched.NewCycleState(), tenantRequest(step.Tenant), eps)
				if version, ok := step.Versions[step.Pick.Member]; ok {
					if got, want := podNames(kept), ofVersion(onlyMembers(step.Versions, table), version); !equalStrings(got, want) {
						t.Fatalf("step %d: kept %q, want the %s pods %q", i, got, version, want)
					}
				} else if len(kept) != len(eps) {
					t.Fatalf("step %d: nothing versioned in the order, but kept %q", i, podNames(kept))
				}
				scores := s.Score(context.Background(), fwksched.NewCycleState(), tenantRequest(step.Tenant), eps)
				if got := top(t, scores); got != step.Pick.Member {
					t.Fatalf("step %d: top %q, the vectors pick %q (scores %v)", i, got, step.Pick.Member, named(scores))
				}
				checked++
			}
		})
	}
	if checked < 10 {
		t.Fatalf("only %d screened vector steps checked; the vectors shrank?", checked)
	}
}

func onlyMembers(versions map[string]string, table *affinity.Table) map[string]string {
	out := map[string]string{}
	for m, v := range versions {
		if _, ok := table.Weight(m); ok {
			out[m] = v
		}
	}
	return out
}

func equalStrings(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestScreenerKeepsTheFirstHomesVersionMidRollout(t *testing.T) {
	path, table := uniform8(t)
	order, _ := table.OrderFor("acme")
	f := newScreener(t, AffinityParameters{TablePath: path})
	versions := map[string]string{}
	for i, m := range order {
		versions[m] = map[bool]string{true: "v2", false: "v1"}[i%2 == 1] // h0 old, h1 new, ...
	}
	kept := f.Filter(context.Background(), nil, tenantRequest("acme"), labelled(order, nil, versions))
	if got, want := podNames(kept), ofVersion(versions, "v1"); !equalStrings(got, want) {
		t.Fatalf("first home on v1: kept %q, want %q", got, want)
	}
	// The rollout moved the first home: the tenant follows it to v2.
	versions[order[0]] = "v2"
	kept = f.Filter(context.Background(), nil, tenantRequest("acme"), labelled(order, nil, versions))
	if got, want := podNames(kept), ofVersion(versions, "v2"); !equalStrings(got, want) {
		t.Fatalf("first home on v2: kept %q, want %q", got, want)
	}
	// Not Ready yet (warming): the new first home is no candidate, the next home decides.
	versions[order[1]] = "v1"
	kept = f.Filter(context.Background(), nil, tenantRequest("acme"), labelled(order[1:], nil, versions))
	want := ofVersion(versions, "v1")
	if got := podNames(kept); !equalStrings(got, want) {
		t.Fatalf("first home warming: kept %q, want the second home's v1 pods %q", got, want)
	}
}

func TestScreenerWithUnknownVersions(t *testing.T) {
	path, table := uniform8(t)
	order, _ := table.OrderFor("acme")
	f := newScreener(t, AffinityParameters{TablePath: path})
	all := labelled(order, nil, nil)
	if kept := f.Filter(context.Background(), nil, tenantRequest("acme"), all); len(kept) != len(all) {
		t.Fatalf("no labels: kept %q of all eight", podNames(kept))
	}
	// An empty label is no version; the first home unlabelled: the next labelled one decides,
	// and unlabelled pods are left out once the version is known.
	eps := labelled(order, nil, map[string]string{order[0]: "", order[2]: "v2", order[4]: "v2", order[5]: "v1"})
	if got, want := podNames(f.Filter(context.Background(), nil, tenantRequest("acme"), eps)),
		[]string{order[2], order[4]}; !equalStrings(got, sortedCopy(want)) {
		t.Fatalf("kept %q, want the v2 pods %q", got, want)
	}
	// A labelled pod the table does not know is kept with its version, not decisive.
	eps = append(labelled(order, nil, map[string]string{order[1]: "v1"}), labelled([]string{"newcomer"}, nil, map[string]string{"newcomer": "v1"})...)
	if got := podNames(f.Filter(context.Background(), nil, tenantRequest("acme"), eps)); !equalStrings(got, sortedCopy([]string{order[1], "newcomer"})) {
		t.Fatalf("kept %q, want %s and the newcomer", got, order[1])
	}
	// Only pods outside the table labelled: nothing in the order to follow, all kept.
	eps = append(labelled(order, nil, nil), labelled([]string{"newcomer"}, nil, map[string]string{"newcomer": "v1"})...)
	if kept := f.Filter(context.Background(), nil, tenantRequest("acme"), eps); len(kept) != len(eps) {
		t.Fatalf("kept %q, want all nine", podNames(kept))
	}
}

func sortedCopy(s []string) []string {
	out := append([]string(nil), s...)
	sort.Strings(out)
	return out
}

// Without a table the candidates are the table, as the scorer routes: the
// tenant's plain-rendezvous first candidate decides its version.
func TestScreenerWithoutATableFollowsPlainRendezvous(t *testing.T) {
	f := newScreener(t, AffinityParameters{TablePath: filepath.Join(t.TempDir(), "missing.json")})
	pods := []string{"pod-a", "pod-b", "pod-c", "pod-d"}
	members := map[string]float64{}
	for _, p := range pods {
		members[p] = 1
	}
	data, _ := json.Marshal(map[string]any{"members": members})
	plain, _ := affinity.Decode(data)
	for _, tenant := range []string{"acme", "globex", "initech", "default"} {
		order, _ := plain.OrderFor(tenant)
		versions := map[string]string{order[0]: "v2", order[1]: "v1", order[2]: "v2", order[3]: "v1"}
		got := podNames(f.Filter(context.Background(), nil, tenantRequest(tenant), labelled(pods, nil, versions)))
		if want := sortedCopy([]string{order[0], order[2]}); !equalStrings(got, want) {
			t.Fatalf("%s: kept %q, want its first candidate's v2 pods %q", tenant, got, want)
		}
	}
}

func TestScreenerNeverEmptiesNorFails(t *testing.T) {
	path, table := uniform8(t)
	order, _ := table.OrderFor("default")
	f := newScreener(t, AffinityParameters{TablePath: path})
	if got := f.Filter(context.Background(), nil, tenantRequest("acme"), nil); len(got) != 0 {
		t.Fatalf("no candidates: %q", podNames(got))
	}
	versions := map[string]string{order[0]: "v1", order[1]: "v2"}
	for name, req := range map[string]*fwksched.LLMRequest{
		"nil request": nil, "no header": request(nil), "invalid UTF-8": tenantRequest("\xff"),
	} {
		if got := podNames(f.Filter(context.Background(), nil, req, labelled(order, nil, versions))); !equalStrings(got, []string{order[0]}) {
			t.Fatalf("%s: kept %q, want the default tenant's first home %s", name, got, order[0])
		}
	}
	// Endpoints with no pod name are no members: with no member labelled, all kept.
	anon := labelled([]string{""}, nil, nil)
	if got := f.Filter(context.Background(), nil, tenantRequest("acme"), anon); len(got) != 1 {
		t.Fatalf("an anonymous endpoint was dropped: %d kept", len(got))
	}
}

func TestScreenerVersionLabelIsConfigurable(t *testing.T) {
	path, table := uniform8(t)
	order, _ := table.OrderFor("acme")
	f := newScreener(t, AffinityParameters{TablePath: path, VersionLabel: "example.com/model-rev"})
	eps := labelled(order, nil, nil)
	for i, ep := range eps {
		ep.GetMetadata().Labels = map[string]string{"example.com/model-rev": []string{"r1", "r2"}[i%2], DefaultVersionLabel: "ignored"}
	}
	got := podNames(f.Filter(context.Background(), nil, tenantRequest("acme"), eps))
	if want := sortedCopy([]string{order[0], order[2], order[4], order[6]}); !equalStrings(got, want) {
		t.Fatalf("kept %q, want the r1 pods %q", got, want)
	}
}

func TestScreenerFactory(t *testing.T) {
	for _, raw := range []string{`{"versionLabel": 3}`, `{"unknown": "x"}`, `{"checkInterval": "soon"}`,
		`{"redisUrl": "redis://localhost:6379"}`} {
		if _, err := VersionScreenerFactory("s", json.RawMessage(raw), nil); err == nil {
			t.Fatalf("parameters %s accepted", raw)
		}
	}
	p, err := VersionScreenerFactory("mine", json.RawMessage(`{"tablePath": "/x", "versionLabel": "a/b"}`), nil)
	if err != nil {
		t.Fatal(err)
	}
	if tn := p.TypedName(); tn.Type != VersionScreenerType || tn.Name != "mine" {
		t.Fatalf("typed name %v", tn)
	}
	if _, ok := p.(fwksched.Filter); !ok {
		t.Fatal("the screener is no scheduling Filter")
	}
}

// The profile's composition: the screener filters, then the scorer picks over
// what it kept. A hot first home spills to the next home of its version, not to
// its new-version second home, nor back onto itself.
func TestScreenerThenScorerSpillsWithinTheVersion(t *testing.T) {
	path, table := uniform8(t)
	order, _ := table.OrderFor("acme")
	f := newScreener(t, AffinityParameters{TablePath: path})
	s := newScorer(t, AffinityParameters{TablePath: path})
	versions := map[string]string{}
	occupancy := map[string]float64{}
	for i, m := range order {
		versions[m], occupancy[m] = "v1", 0.3
		if i == 1 || i == 3 {
			versions[m] = "v2"
		}
	}
	occupancy[order[0]] = 0.95
	kept := f.Filter(context.Background(), nil, tenantRequest("acme"), labelled(order, occupancy, versions))
	if got := top(t, s.Score(context.Background(), nil, tenantRequest("acme"), kept)); got != order[2] {
		t.Fatalf("hot first home on v1: went to %q, want its next v1 home %s", got, order[2])
	}
}
