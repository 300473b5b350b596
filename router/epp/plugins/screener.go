package plugins

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"

	"github.com/kvtier/kvtier/router/affinity"
	fwkplugin "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/plugin"
	fwksched "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/scheduling"
)

const (
	// VersionScreenerType is the plugin type an EndpointPickerConfig names.
	VersionScreenerType = "kvtier-version-screener"
	// DefaultVersionLabel is the pod label carrying its weights version, which
	// kvtier's injection webhook sets from the pod's kvtier.io/weights-version
	// annotation (kvtier.names.WEIGHTS_VERSION_LABEL).
	DefaultVersionLabel = "kvtier.io/weights-version"
)

// VersionScreener is a scheduling Filter that keeps, while the operator rolls
// a new weights version, only the candidates of the version the tenant's first
// home serves (affinity.Screen): that pod was warmed for the tenant before it
// became Ready, and a user must not flip between model versions from one
// request to the next, however hot the tenant's own version runs.
//
// A candidate's version is its pod's version label; a pod without one has no
// known version. The tenant's version is that of the first member of its order
// (the affinity table's, or plain rendezvous over the candidates without a
// table, as the scorer routes) that is a candidate with a version; a home that
// is not a candidate (not Ready yet: still warming) does not decide. The
// candidates kept are those labelled with that version, members of the table
// or not. With no labelled candidate every candidate is kept; the filter never
// returns an empty list for a non-empty one and never fails a request.
type VersionScreener struct {
	typedName     fwkplugin.TypedName
	source        *tableSource
	tenantHeader  string
	defaultTenant string
	versionLabel  string
}

var _ fwksched.Filter = (*VersionScreener)(nil)

// VersionScreenerFactory makes the screener from the scorer's parameters (the
// same table source and tenant header) and versionLabel; a bad parameter fails
// the EPP's start, never a request.
func VersionScreenerFactory(name string, raw json.RawMessage, handle fwkplugin.Handle) (fwkplugin.Plugin, error) {
	p, err := decodeParameters(VersionScreenerType, raw)
	if err != nil {
		return nil, err
	}
	s, err := NewVersionScreener(p)
	if err != nil {
		return nil, err
	}
	s.typedName.Name = name
	go s.source.runRedis(handleContext(handle))
	return s, nil
}

// NewVersionScreener makes a screener; the caller runs its Redis poller (Factory does).
func NewVersionScreener(p AffinityParameters) (*VersionScreener, error) {
	source, err := newParameterSource(VersionScreenerType, p)
	if err != nil {
		return nil, err
	}
	return &VersionScreener{
		typedName:     fwkplugin.TypedName{Type: VersionScreenerType, Name: VersionScreenerType},
		source:        source,
		tenantHeader:  strings.ToLower(orDefault(p.TenantHeader, DefaultTenantHeader)),
		defaultTenant: orDefault(p.DefaultTenant, DefaultTenant),
		versionLabel:  orDefault(p.VersionLabel, DefaultVersionLabel),
	}, nil
}

// TypedName is the plugin's type and configured name.
func (s *VersionScreener) TypedName() fwkplugin.TypedName { return s.typedName }

// Filter keeps the candidates of the tenant's version (see VersionScreener).
func (s *VersionScreener) Filter(_ context.Context, _ *fwksched.CycleState, req *fwksched.LLMRequest, eps []fwksched.Endpoint) []fwksched.Endpoint {
	byMember := membersOf(eps)
	versions := endpointVersions(byMember, s.versionLabel)
	if len(versions) == 0 {
		return eps
	}
	table := s.source.Table()
	if table == nil || !knowsAny(table, byMember) {
		if table = candidatesTable(byMember); table == nil {
			return eps
		}
	}
	order, err := table.OrderFor(tenantOf(req, s.tenantHeader, s.defaultTenant))
	if err != nil {
		return eps
	}
	version, ok := "", false
	if screened := affinity.Screen(order, versions); len(screened) > 0 {
		version, ok = versions[screened[0]]
	}
	if !ok {
		return eps // no member of the order is a labelled candidate: nothing to follow
	}
	kept := make([]fwksched.Endpoint, 0, len(eps))
	for _, ep := range eps {
		if v, ok := versions[MemberName(ep)]; ok && v == version {
			kept = append(kept, ep)
		}
	}
	if len(kept) == 0 {
		return eps
	}
	return kept
}

// membersOf groups the endpoints by member name (an endpoint with none is left out).
func membersOf(eps []fwksched.Endpoint) map[string][]fwksched.Endpoint {
	byMember := make(map[string][]fwksched.Endpoint, len(eps))
	for _, ep := range eps {
		if m := MemberName(ep); m != "" {
			byMember[m] = append(byMember[m], ep)
		}
	}
	return byMember
}

// endpointVersions is member -> its pod's version label, for the candidates
// that carry a non-empty one ("" is no version: nobody set it).
func endpointVersions(byMember map[string][]fwksched.Endpoint, label string) map[string]string {
	var versions map[string]string
	for m, list := range byMember {
		meta := list[0].GetMetadata()
		if meta == nil {
			continue
		}
		if v := meta.Labels[label]; v != "" {
			if versions == nil {
				versions = make(map[string]string, len(byMember))
			}
			versions[m] = v
		}
	}
	return versions
}

// decodeParameters reads a plugin's AffinityParameters strictly.
func decodeParameters(pluginType string, raw json.RawMessage) (AffinityParameters, error) {
	return decodeStrict[AffinityParameters](pluginType, raw)
}

// decodeStrict reads a plugin's parameters, refusing unknown fields; none given
// is T's zero value.
func decodeStrict[T any](pluginType string, raw json.RawMessage) (T, error) {
	var p T
	if len(raw) > 0 {
		dec := json.NewDecoder(strings.NewReader(string(raw)))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&p); err != nil {
			return p, fmt.Errorf("%s parameters: %v", pluginType, err)
		}
	}
	return p, nil
}

func handleContext(handle fwkplugin.Handle) context.Context {
	if handle != nil && handle.Context() != nil {
		return handle.Context()
	}
	return context.Background()
}
