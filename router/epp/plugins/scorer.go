// Package plugins is kvtier's Endpoint Picker plugins, compiled into the
// Gateway API Inference Extension's EPP (cmd/kvtier-epp):
//
//   - kvtier-affinity-scorer: scores each candidate endpoint by the decision of
//     affinity.Pick for the request's tenant — the picked member 1.0, the
//     tenant's other homes lower, everyone else 0 — over the affinity table the
//     operator publishes (the ConfigMap's table.json mounted as a file, and
//     optionally its Redis key);
//   - kvtier-version-screener: while the operator rolls a new weights version,
//     keeps the candidates of the version the tenant's first home serves (the
//     pods' kvtier.io/weights-version label), so a tenant never flips between
//     model versions;
//   - kvtier-cache-salt: sets vLLM's cache_salt in the request body to the
//     tenant when the request names none, so vLLM's prefix keys and kvtier's
//     follow the same tenant.
//
// Neither ever fails a request: a missing or bad table routes on the last good
// one, and with none at all on plain rendezvous over the candidates; a request
// without the tenant header is the default tenant's.
package plugins

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"sort"
	"strings"
	"time"

	"github.com/kvtier/kvtier/router/affinity"
	fwkplugin "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/plugin"
	fwksched "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/scheduling"
)

const (
	// AffinityScorerType is the plugin type an EndpointPickerConfig names.
	AffinityScorerType = "kvtier-affinity-scorer"
	// DefaultTenantHeader carries the tenant unless the config names another.
	DefaultTenantHeader = "x-tenant-id"
	// DefaultTenant routes requests that name no tenant, as the connector keys
	// requests without a cache_salt (connector/kvtier_vllm/config.py).
	DefaultTenant = "default"
	// DefaultTablePath is where the chart mounts the policy's affinity ConfigMap.
	DefaultTablePath = "/etc/kvtier-affinity/table.json"
)

// Score of the tenant's other homes: below the pick, above every non-home, in
// rank order (homeScoreTop for rank 0 down to homeScoreTop/homes).
const homeScoreTop = 0.5

var logf = log.Printf

// AffinityParameters is the scorer's `parameters` in an EndpointPickerConfig.
type AffinityParameters struct {
	// TablePath is the affinity table's file (the ConfigMap's table.json). "" for none.
	TablePath string `json:"tablePath"`
	// CheckInterval is how often the file is re-read (Go duration, default "1s").
	CheckInterval string `json:"checkInterval"`
	// RedisURL (redis://[user:password@]host:port[/db]) and RedisKey name the
	// operator's Redis copy (kvt:affinity:<namespace>:<policy>); "" for none.
	RedisURL string `json:"redisUrl"`
	RedisKey string `json:"redisKey"`
	// RedisPasswordFile is a file holding Redis's password (a mounted Secret's
	// key), read at start and before each poll, so a rotated Secret is followed.
	// With it the URL carries no password; "" for none.
	RedisPasswordFile string `json:"redisPasswordFile"`
	// RedisInterval is how often Redis is polled (default "1s").
	RedisInterval string `json:"redisInterval"`
	// TenantHeader names the request header carrying the tenant (default x-tenant-id).
	TenantHeader string `json:"tenantHeader"`
	// DefaultTenant routes requests without the header (default "default").
	DefaultTenant string `json:"defaultTenant"`
	// VersionLabel is the pod label carrying its weights version (default
	// kvtier.io/weights-version): the screener keeps a tenant's version, and the
	// scorer walks the tenant's order over the candidates of that version.
	VersionLabel string `json:"versionLabel"`
}

// AffinityScorer routes each tenant to its homes as kvtier.routing.pick does.
type AffinityScorer struct {
	typedName     fwkplugin.TypedName
	source        *tableSource
	spill         *affinity.SpillState
	tenantHeader  string
	defaultTenant string
	versionLabel  string
}

var _ fwksched.Scorer = (*AffinityScorer)(nil)

// AffinityScorerFactory makes the scorer from its parameters; a bad parameter
// fails the EPP's start (a configuration error), never a request.
func AffinityScorerFactory(name string, raw json.RawMessage, handle fwkplugin.Handle) (fwkplugin.Plugin, error) {
	p, err := decodeParameters(AffinityScorerType, raw)
	if err != nil {
		return nil, err
	}
	s, err := NewAffinityScorer(p)
	if err != nil {
		return nil, err
	}
	s.typedName.Name = name
	go s.source.runRedis(handleContext(handle))
	return s, nil
}

// NewAffinityScorer makes a scorer; the caller runs its Redis poller (Factory does).
func NewAffinityScorer(p AffinityParameters) (*AffinityScorer, error) {
	source, err := newParameterSource(AffinityScorerType, p)
	if err != nil {
		return nil, err
	}
	s := &AffinityScorer{
		typedName:     fwkplugin.TypedName{Type: AffinityScorerType, Name: AffinityScorerType},
		source:        source,
		spill:         affinity.NewSpillState(),
		tenantHeader:  strings.ToLower(orDefault(p.TenantHeader, DefaultTenantHeader)),
		defaultTenant: orDefault(p.DefaultTenant, DefaultTenant),
		versionLabel:  orDefault(p.VersionLabel, DefaultVersionLabel),
	}
	return s, nil
}

// newParameterSource is the table source the parameters name (file, and Redis if set).
func newParameterSource(pluginType string, p AffinityParameters) (*tableSource, error) {
	check, err := duration(pluginType, p.CheckInterval, time.Second, "checkInterval")
	if err != nil {
		return nil, err
	}
	var redis *redisReader
	if p.RedisURL != "" {
		if p.RedisKey == "" {
			return nil, fmt.Errorf("%s: redisUrl needs redisKey (kvt:affinity:<namespace>:<policy>)", pluginType)
		}
		every, err := duration(pluginType, p.RedisInterval, time.Second, "redisInterval")
		if err != nil {
			return nil, err
		}
		if redis, err = newRedisReaderWithPasswordFile(p.RedisURL, p.RedisKey, every, p.RedisPasswordFile); err != nil {
			return nil, fmt.Errorf("%s: %v", pluginType, err)
		}
	} else if p.RedisPasswordFile != "" {
		return nil, fmt.Errorf("%s: redisPasswordFile needs redisUrl", pluginType)
	}
	return newTableSource(p.TablePath, check, redis), nil
}

func duration(pluginType, s string, def time.Duration, what string) (time.Duration, error) {
	if s == "" {
		return def, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil || d < 0 {
		return 0, fmt.Errorf("%s: %s %q is not a duration >= 0", pluginType, what, s)
	}
	return d, nil
}

func orDefault(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

// TypedName is the plugin's type and configured name.
func (s *AffinityScorer) TypedName() fwkplugin.TypedName { return s.typedName }

// Category: the scorer keeps a tenant where its prefixes are.
func (s *AffinityScorer) Category() fwksched.ScorerCategory { return fwksched.Affinity }

// Tenant of a request: the header's value, else the default tenant. A value
// that is not a usable name (not valid UTF-8) is the default tenant's too.
func (s *AffinityScorer) Tenant(req *fwksched.LLMRequest) string {
	return tenantOf(req, s.tenantHeader, s.defaultTenant)
}

func tenantOf(req *fwksched.LLMRequest, header, def string) string {
	if req == nil {
		return def
	}
	for k, v := range req.Headers {
		if strings.ToLower(k) == header {
			if v = strings.TrimSpace(v); v != "" && validName(v) {
				return v
			}
			break
		}
	}
	return def
}

// MemberName is the table's name for an endpoint: its pod's name (the
// operator's members are pod names).
func MemberName(ep fwksched.Endpoint) string {
	meta := ep.GetMetadata()
	if meta == nil {
		return ""
	}
	if meta.PodName != "" {
		return meta.PodName
	}
	return meta.NamespacedName.Name
}

// Score gives the member affinity.Pick chooses 1.0 (the first candidate in the
// tenant's order if that member is no candidate), the tenant's other homes
// homeScoreTop x (homes-rank)/homes, everyone else 0. Endpoints the table does
// not know score 0; with no table ever read, the candidates themselves are
// the table (plain rendezvous, default knobs). When candidates carry the
// version label, the pick walks the tenant's order screened by their versions
// (affinity.PickVersioned): only candidates of its first home's version, so a
// hot home spills to the next pod of its version, never to a filtered-out one.
func (s *AffinityScorer) Score(_ context.Context, _ *fwksched.CycleState, req *fwksched.LLMRequest, eps []fwksched.Endpoint) map[fwksched.Endpoint]float64 {
	scores := make(map[fwksched.Endpoint]float64, len(eps))
	for _, ep := range eps {
		scores[ep] = 0
	}
	if len(eps) == 0 {
		return scores
	}
	tenant := s.Tenant(req)
	table, state := s.source.Table(), s.spill
	byMember := membersOf(eps)
	if table == nil || !knowsAny(table, byMember) {
		// Plain rendezvous over the candidates; its spill memory would mix with
		// the table's, so it keeps none.
		table, state = candidatesTable(byMember), nil
		if table == nil {
			return scores
		}
	}
	occupancy := make(map[string]float64, len(byMember))
	for m, list := range byMember {
		// Never scraped (no update time): no report, as kvtier.routing treats a
		// member without one (empty, and left out of the fleet mean).
		if mt := list[0].GetMetrics(); mt != nil && !mt.UpdateTime.IsZero() {
			occupancy[m] = mt.KVCacheUsagePercent
		}
	}
	pick, err := table.PickVersioned(tenant, occupancy, state, endpointVersions(byMember, s.versionLabel))
	if err != nil {
		return scores
	}
	order, _ := table.OrderFor(tenant)
	homes := min(table.Homes(), len(order))
	for rank, m := range order[:homes] {
		for _, ep := range byMember[m] {
			scores[ep] = homeScoreTop * float64(homes-rank) / float64(homes)
		}
	}
	chosen := pick.Member
	if _, ok := byMember[chosen]; !ok {
		// The table's pick is not among the candidates (not ready, or filtered
		// out): the first candidate in the tenant's order stands in for it.
		for _, m := range order {
			if _, ok := byMember[m]; ok {
				chosen = m
				break
			}
		}
	}
	for _, ep := range byMember[chosen] {
		scores[ep] = 1
	}
	return scores
}

func knowsAny(t *affinity.Table, byMember map[string][]fwksched.Endpoint) bool {
	for m := range byMember {
		if _, ok := t.Weight(m); ok {
			return true
		}
	}
	return false
}

func candidatesTable(byMember map[string][]fwksched.Endpoint) *affinity.Table {
	names := make([]string, 0, len(byMember))
	for m := range byMember {
		if validName(m) {
			names = append(names, m)
		}
	}
	if len(names) == 0 {
		return nil
	}
	sort.Strings(names)
	members := make(map[string]float64, len(names))
	for _, m := range names {
		members[m] = 1
	}
	data, err := json.Marshal(map[string]any{"members": members})
	if err != nil {
		return nil
	}
	t, err := affinity.Decode(data)
	if err != nil {
		return nil
	}
	return t
}
