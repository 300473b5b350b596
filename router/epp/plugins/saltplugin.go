package plugins

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"unicode/utf8"

	fwkplugin "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/plugin"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/requestcontrol"
	fwksched "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/scheduling"
)

// CacheSaltType is the plugin type of the cache_salt setter.
const CacheSaltType = "kvtier-cache-salt"

// CacheSaltParameters: the same header the scorer reads.
type CacheSaltParameters struct {
	TenantHeader string `json:"tenantHeader"`
}

// CacheSalt is a PreRequest plugin: when the request carries the tenant header
// and names no cache_salt, it sets cache_salt to the tenant in the body the EPP
// forwards (this EPP re-marshals a parsed JSON body after its PreRequest
// plugins run, so a change to the parsed map reaches the model server). A
// request without the header is left alone: the connector already keys a
// request without a cache_salt as the default tenant.
type CacheSalt struct {
	typedName    fwkplugin.TypedName
	tenantHeader string
}

var _ requestcontrol.PreRequest = (*CacheSalt)(nil)

// CacheSaltFactory makes the plugin from its parameters.
func CacheSaltFactory(name string, raw json.RawMessage, _ fwkplugin.Handle) (fwkplugin.Plugin, error) {
	p := CacheSaltParameters{}
	if len(raw) > 0 {
		dec := json.NewDecoder(strings.NewReader(string(raw)))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&p); err != nil {
			return nil, fmt.Errorf("%s parameters: %v", CacheSaltType, err)
		}
	}
	return NewCacheSalt(p, name), nil
}

// NewCacheSalt makes the plugin.
func NewCacheSalt(p CacheSaltParameters, name string) *CacheSalt {
	return &CacheSalt{
		typedName:    fwkplugin.TypedName{Type: CacheSaltType, Name: orDefault(name, CacheSaltType)},
		tenantHeader: strings.ToLower(orDefault(p.TenantHeader, DefaultTenantHeader)),
	}
}

// TypedName is the plugin's type and configured name.
func (c *CacheSalt) TypedName() fwkplugin.TypedName { return c.typedName }

// PreRequest sets cache_salt if the request has a tenant and no salt of its own.
func (c *CacheSalt) PreRequest(_ context.Context, req *fwksched.LLMRequest, _ *fwksched.SchedulingResult) {
	if req == nil || req.Body == nil {
		return
	}
	tenant := tenantOf(req, c.tenantHeader, "")
	if tenant == "" {
		return
	}
	body, ok := req.Body.Payload.(fwksched.PayloadMap)
	if !ok || body == nil {
		return // a proto or raw body: this EPP forwards those unchanged
	}
	if salt, ok := body["cache_salt"].(string); ok && salt != "" {
		return
	}
	body["cache_salt"] = tenant
	switch b := req.Body; {
	case b.ChatCompletions != nil:
		b.ChatCompletions.CacheSalt = tenant
	case b.Completions != nil:
		b.Completions.CacheSalt = tenant
	case b.Responses != nil:
		b.Responses.CacheSalt = tenant
	case b.Conversations != nil:
		b.Conversations.CacheSalt = tenant
	case b.Embeddings != nil:
		b.Embeddings.CacheSalt = tenant
	}
}

func validName(s string) bool { return s != "" && utf8.ValidString(s) }
