package plugins

import (
	"context"
	"encoding/json"
	"net"
	"regexp"
	"strconv"
	"strings"
	"unicode/utf8"

	fwkplugin "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/plugin"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/requestcontrol"
	fwksched "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/scheduling"
)

// CacheSaltType is the plugin type of the cache_salt setter.
const CacheSaltType = "kvtier-cache-salt"

// DefaultSourcePeerHeader is the header llm-d's router sets to the host:port of
// a pod that holds the request's prefix KV (the peer-pull hint).
const DefaultSourcePeerHeader = "x-kv-cache-source-host-port"

// The body's kv_transfer_params entry the connector reads the hint from:
// kv_transfer_params.kvtier.sourcePeer (kvtier.names.SOURCE_PEER_FIELD).
const (
	kvTransferParamsField = "kv_transfer_params"
	kvTransferParamsKey   = "kvtier"
	sourcePeerField       = "sourcePeer"
)

// CacheSaltParameters: the same tenant header the scorer reads, and the header
// that carries the peer-pull hint.
type CacheSaltParameters struct {
	TenantHeader     string `json:"tenantHeader"`
	SourcePeerHeader string `json:"sourcePeerHeader"`
}

// CacheSalt is a PreRequest plugin: when the request carries the tenant header
// and names no cache_salt, it sets cache_salt to the tenant in the body the EPP
// forwards (this EPP re-marshals a parsed JSON body after its PreRequest
// plugins run, so a change to the parsed map reaches the model server). A
// request without the header is left alone: the connector already keys a
// request without a cache_salt as the default tenant.
//
// It also carries the peer-pull hint to the connector: vLLM hands a KV connector
// the body's kv_transfer_params, never the HTTP headers, so a well-formed
// host:port in the source-peer header is copied to
// kv_transfer_params.kvtier.sourcePeer (see SetSourcePeer).
type CacheSalt struct {
	typedName        fwkplugin.TypedName
	tenantHeader     string
	sourcePeerHeader string
}

var _ requestcontrol.PreRequest = (*CacheSalt)(nil)

// CacheSaltFactory makes the plugin from its parameters.
func CacheSaltFactory(name string, raw json.RawMessage, _ fwkplugin.Handle) (fwkplugin.Plugin, error) {
	p, err := decodeStrict[CacheSaltParameters](CacheSaltType, raw)
	if err != nil {
		return nil, err
	}
	return NewCacheSalt(p, name), nil
}

// NewCacheSalt makes the plugin.
func NewCacheSalt(p CacheSaltParameters, name string) *CacheSalt {
	return &CacheSalt{
		typedName:        fwkplugin.TypedName{Type: CacheSaltType, Name: orDefault(name, CacheSaltType)},
		tenantHeader:     strings.ToLower(orDefault(p.TenantHeader, DefaultTenantHeader)),
		sourcePeerHeader: strings.ToLower(orDefault(p.SourcePeerHeader, DefaultSourcePeerHeader)),
	}
}

// TypedName is the plugin's type and configured name.
func (c *CacheSalt) TypedName() fwkplugin.TypedName { return c.typedName }

// PreRequest sets cache_salt if the request has a tenant and no salt of its
// own, and copies the peer-pull hint into kv_transfer_params.
func (c *CacheSalt) PreRequest(_ context.Context, req *fwksched.LLMRequest, _ *fwksched.SchedulingResult) {
	if req == nil || req.Body == nil {
		return
	}
	body, ok := req.Body.Payload.(fwksched.PayloadMap)
	if !ok || body == nil {
		return // a proto or raw body: this EPP forwards those unchanged
	}
	if peer, ok := sourcePeerOf(req, c.sourcePeerHeader); ok {
		SetSourcePeer(body, peer)
	}
	if tenant := tenantOf(req, c.tenantHeader, ""); tenant != "" {
		setCacheSalt(req.Body, body, tenant)
	}
}

func setCacheSalt(b *fwksched.LLMRequestBody, body fwksched.PayloadMap, tenant string) {
	if salt, ok := body["cache_salt"].(string); ok && salt != "" {
		return
	}
	body["cache_salt"] = tenant
	switch {
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

// childObject is m[key] as a JSON object, made empty when absent; false when m[key]
// holds something else (left as it is).
func childObject(m map[string]any, key string) (map[string]any, bool) {
	child, ok := m[key].(map[string]any)
	if ok {
		return child, true
	}
	if m[key] != nil {
		return nil, false
	}
	child = map[string]any{}
	m[key] = child
	return child, true
}

// SetSourcePeer merges {"kvtier": {"sourcePeer": peer}} into the body's
// kv_transfer_params, creating what is missing. What the client set wins: a
// sourcePeer of its own is kept, and a kv_transfer_params (or its kvtier entry)
// that is not a JSON object is left as it is (the connector ignores it).
func SetSourcePeer(body fwksched.PayloadMap, peer string) {
	params, ok := childObject(body, kvTransferParamsField)
	if !ok {
		return
	}
	ours, ok := childObject(params, kvTransferParamsKey)
	if !ok {
		return
	}
	if _, set := ours[sourcePeerField]; set {
		return
	}
	ours[sourcePeerField] = peer
}

// sourcePeerOf is the request's hint header when it is a well-formed host:port
// (ParseSourcePeer); a missing or malformed value is no hint.
func sourcePeerOf(req *fwksched.LLMRequest, header string) (string, bool) {
	for k, v := range req.Headers {
		if strings.ToLower(k) == header {
			return ParseSourcePeer(v)
		}
	}
	return "", false
}

// maxHostChars: a whole DNS name is at most 253 characters (RFC 1123).
const maxHostChars = 253

var dnsLabel = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$`)

// ParseSourcePeer returns the hint in its canonical host:port form ([v6]:port
// for IPv6), or false for anything else: no port, a port outside 1..65535, a
// host that is neither an IP literal nor a DNS name. The value only ever names
// a peer to prefer; the sidecar dials it only if it is a member of its own
// fleet, so this check keeps junk out of the body, it is not the security gate.
func ParseSourcePeer(value string) (string, bool) {
	host, port, err := net.SplitHostPort(strings.TrimSpace(value))
	if err != nil || host == "" {
		return "", false
	}
	n, err := strconv.Atoi(port)
	if err != nil || n < 1 || n > 65535 || len(port) > 5 || strings.TrimLeft(port, "0123456789") != "" {
		return "", false
	}
	if ip := net.ParseIP(host); ip != nil {
		if strings.Contains(host, "%") {
			return "", false // a zone names an interface of the router's own host
		}
		return net.JoinHostPort(ip.String(), strconv.Itoa(n)), true
	}
	if !validHostName(host) {
		return "", false
	}
	return net.JoinHostPort(strings.ToLower(host), strconv.Itoa(n)), true
}

// validHostName: RFC 1123 labels, at least two of them (a single label resolves
// differently under each pod's DNS search path), and not a malformed IPv4
// address (all digits and dots); the rules of kvtier.peer_address.parse_peer.
func validHostName(host string) bool {
	if len(host) > maxHostChars || strings.Trim(host, "0123456789.") == "" {
		return false
	}
	labels := strings.Split(strings.TrimSuffix(host, "."), ".")
	if len(labels) < 2 {
		return false
	}
	for _, label := range labels {
		if !dnsLabel.MatchString(label) {
			return false
		}
	}
	return true
}

func validName(s string) bool { return s != "" && utf8.ValidString(s) }
