package plugins

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	fwksched "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/scheduling"
)

// chatRequest parses a body the way the EPP's OpenAI parser leaves it: the
// typed view and the map the EPP re-marshals into what it forwards.
func chatRequest(t *testing.T, headers map[string]string, body string) *fwksched.LLMRequest {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal([]byte(body), &m); err != nil {
		t.Fatal(err)
	}
	var chat fwksched.ChatCompletionsRequest
	if err := json.Unmarshal([]byte(body), &chat); err != nil {
		t.Fatal(err)
	}
	req := request(headers)
	req.Body = &fwksched.LLMRequestBody{ChatCompletions: &chat, Payload: fwksched.PayloadMap(m)}
	return req
}

func forwarded(t *testing.T, req *fwksched.LLMRequest) map[string]any {
	t.Helper()
	data, err := json.Marshal(req.Body.Payload)
	if err != nil {
		t.Fatal(err)
	}
	var out map[string]any
	if err := json.Unmarshal(data, &out); err != nil {
		t.Fatal(err)
	}
	return out
}

const chatBody = `{"model": "m", "messages": [{"role": "user", "content": "hi"}]}`

func TestCacheSaltSetFromTheTenant(t *testing.T) {
	p := NewCacheSalt(CacheSaltParameters{}, "")
	req := chatRequest(t, map[string]string{"x-tenant-id": "acme"}, chatBody)
	p.PreRequest(context.Background(), req, nil)
	out := forwarded(t, req)
	if out["cache_salt"] != "acme" {
		t.Fatalf("forwarded body %v: cache_salt should be the tenant", out)
	}
	if out["model"] != "m" || out["messages"] == nil {
		t.Fatalf("forwarded body lost fields: %v", out)
	}
	if req.Body.CacheSalt() != "acme" {
		t.Fatalf("typed view's cache_salt %q", req.Body.CacheSalt())
	}
}

func TestCacheSaltKeepsTheRequestsOwn(t *testing.T) {
	p := NewCacheSalt(CacheSaltParameters{}, "")
	req := chatRequest(t, map[string]string{"x-tenant-id": "acme"},
		`{"model": "m", "messages": [], "cache_salt": "mine"}`)
	p.PreRequest(context.Background(), req, nil)
	if got := forwarded(t, req)["cache_salt"]; got != "mine" {
		t.Fatalf("cache_salt %v, want the request's own", got)
	}
}

func TestCacheSaltLeavesAnonymousRequestsAlone(t *testing.T) {
	p := NewCacheSalt(CacheSaltParameters{TenantHeader: "x-org"}, "salt")
	for _, h := range []map[string]string{nil, {"x-tenant-id": "acme"}, {"x-org": ""}} {
		req := chatRequest(t, h, chatBody)
		p.PreRequest(context.Background(), req, nil)
		if _, ok := forwarded(t, req)["cache_salt"]; ok {
			t.Fatalf("headers %v: a cache_salt was set without the tenant header", h)
		}
	}
	req := chatRequest(t, map[string]string{"X-Org": "acme"}, chatBody)
	p.PreRequest(context.Background(), req, nil)
	if got := forwarded(t, req)["cache_salt"]; got != "acme" {
		t.Fatalf("configured header: cache_salt %v", got)
	}
	// Bodies it cannot change are left as they are, without a panic.
	p.PreRequest(context.Background(), nil, nil)
	raw := request(map[string]string{"x-org": "acme"})
	raw.Body = &fwksched.LLMRequestBody{Payload: fwksched.RawPayload("x")}
	p.PreRequest(context.Background(), raw, nil)
	if string(raw.Body.Payload.(fwksched.RawPayload)) != "x" {
		t.Fatal("a raw body was changed")
	}
}

func sourcePeerIn(t *testing.T, out map[string]any) (any, bool) {
	t.Helper()
	params, ok := out["kv_transfer_params"].(map[string]any)
	if !ok {
		return nil, false
	}
	ours, ok := params["kvtier"].(map[string]any)
	if !ok {
		return nil, false
	}
	peer, ok := ours["sourcePeer"]
	return peer, ok
}

func TestCacheSaltCopiesTheSourcePeerHintIntoKVTransferParams(t *testing.T) {
	p := NewCacheSalt(CacheSaltParameters{}, "")
	// No tenant header: the hint is carried all the same, and no cache_salt is set.
	req := chatRequest(t, map[string]string{"X-KV-Cache-Source-Host-Port": " 10.0.0.7:8200 "}, chatBody)
	p.PreRequest(context.Background(), req, nil)
	out := forwarded(t, req)
	if peer, _ := sourcePeerIn(t, out); peer != "10.0.0.7:8200" {
		t.Fatalf("forwarded body %v: kv_transfer_params.kvtier.sourcePeer should be the header's", out)
	}
	if _, ok := out["cache_salt"]; ok || out["model"] != "m" || out["messages"] == nil {
		t.Fatalf("forwarded body %v: only the hint should have been added", out)
	}
	// Both headers: both changes.
	req = chatRequest(t, map[string]string{"x-tenant-id": "acme", "x-kv-cache-source-host-port": "[FD00::7]:80"}, chatBody)
	p.PreRequest(context.Background(), req, nil)
	out = forwarded(t, req)
	if peer, _ := sourcePeerIn(t, out); peer != "[fd00::7]:80" || out["cache_salt"] != "acme" {
		t.Fatalf("forwarded body %v", out)
	}
	// The configured header name.
	p = NewCacheSalt(CacheSaltParameters{SourcePeerHeader: "X-Prefix-Holder"}, "")
	req = chatRequest(t, map[string]string{"x-prefix-holder": "pod-1.serving.ns.svc:7400",
		"x-kv-cache-source-host-port": "10.0.0.9:1"}, chatBody)
	p.PreRequest(context.Background(), req, nil)
	if peer, _ := sourcePeerIn(t, forwarded(t, req)); peer != "pod-1.serving.ns.svc:7400" {
		t.Fatalf("configured header: sourcePeer %v", peer)
	}
}

func TestCacheSaltMergesTheHintAndKeepsWhatTheClientSet(t *testing.T) {
	p := NewCacheSalt(CacheSaltParameters{}, "")
	hint := map[string]string{"x-kv-cache-source-host-port": "10.0.0.7:8200"}
	// Merged into the client's kv_transfer_params: other connectors' entries and
	// kvtier's own other fields stay.
	req := chatRequest(t, hint, `{"model": "m", "messages": [],
		"kv_transfer_params": {"nixl": {"x": 1}, "kvtier": {"purpose": "warmup"}}}`)
	p.PreRequest(context.Background(), req, nil)
	out := forwarded(t, req)
	params := out["kv_transfer_params"].(map[string]any)
	ours := params["kvtier"].(map[string]any)
	if ours["sourcePeer"] != "10.0.0.7:8200" || ours["purpose"] != "warmup" || params["nixl"] == nil {
		t.Fatalf("kv_transfer_params %v: the hint should be merged in", params)
	}
	req = chatRequest(t, hint, `{"model": "m", "messages": [], "kv_transfer_params": {"nixl": {}}}`)
	p.PreRequest(context.Background(), req, nil)
	params = forwarded(t, req)["kv_transfer_params"].(map[string]any)
	if peer, _ := sourcePeerIn(t, forwarded(t, req)); peer != "10.0.0.7:8200" || params["nixl"] == nil {
		t.Fatalf("kv_transfer_params %v: the kvtier entry should be added beside the others", params)
	}
	// What the client set is never overwritten, whatever it is.
	for _, body := range []string{
		`{"model": "m", "kv_transfer_params": {"kvtier": {"sourcePeer": "10.0.0.1:1"}}}`,
		`{"model": "m", "kv_transfer_params": {"kvtier": {"sourcePeer": null}}}`,
		`{"model": "m", "kv_transfer_params": {"kvtier": {"sourcePeer": 7}}}`,
		`{"model": "m", "kv_transfer_params": {"kvtier": "opaque"}}`,
		`{"model": "m", "kv_transfer_params": ["not", "an", "object"]}`,
		`{"model": "m", "kv_transfer_params": "text"}`,
	} {
		req := chatRequest(t, hint, body)
		var want map[string]any
		if err := json.Unmarshal([]byte(body), &want); err != nil {
			t.Fatal(err)
		}
		p.PreRequest(context.Background(), req, nil)
		got, _ := json.Marshal(forwarded(t, req)["kv_transfer_params"])
		was, _ := json.Marshal(want["kv_transfer_params"])
		if string(got) != string(was) {
			t.Fatalf("body %s: kv_transfer_params became %s", body, got)
		}
	}
	// A null kv_transfer_params is no value: the hint takes its place.
	req = chatRequest(t, hint, `{"model": "m", "kv_transfer_params": null}`)
	p.PreRequest(context.Background(), req, nil)
	if peer, _ := sourcePeerIn(t, forwarded(t, req)); peer != "10.0.0.7:8200" {
		t.Fatalf("null kv_transfer_params: sourcePeer %v", peer)
	}
}

func TestCacheSaltIgnoresAMalformedHint(t *testing.T) {
	p := NewCacheSalt(CacheSaltParameters{}, "")
	for _, value := range []string{
		"", " ", "10.0.0.7", "10.0.0.7:", ":8200", "10.0.0.7:0", "10.0.0.7:65536", "10.0.0.7:-1",
		"10.0.0.7:+80", "10.0.0.7:000080", "10.0.0.7:80x", "10.0.0.7:8200:1", "fd00::7:80", "[fd00::7%eth0]:80",
		"999.0.0.1:80", "1.2.3:80", "localhost:80", "pod_1.ns:80", "-pod.ns:80", "a b.ns:80", "http://10.0.0.7:80",
		"10.0.0.7:80/x", "\xff.ns:80", strings.Repeat("a.", 127) + "ab:80",
	} {
		req := chatRequest(t, map[string]string{"x-tenant-id": "acme", "x-kv-cache-source-host-port": value}, chatBody)
		p.PreRequest(context.Background(), req, nil)
		out := forwarded(t, req)
		if _, ok := out["kv_transfer_params"]; ok {
			t.Fatalf("header %q: a malformed hint reached the body: %v", value, out)
		}
		if out["cache_salt"] != "acme" {
			t.Fatalf("header %q: the cache_salt must still be set", value)
		}
	}
	for value, want := range map[string]string{
		"10.0.0.7:1": "10.0.0.7:1", "10.0.0.7:65535": "10.0.0.7:65535", "[::1]:7400": "[::1]:7400",
		"Pod-0.Serving.NS.svc:7400": "pod-0.serving.ns.svc:7400", "pod.ns.:7400": "pod.ns.:7400",
	} {
		if got, ok := ParseSourcePeer(value); !ok || got != want {
			t.Fatalf("ParseSourcePeer(%q) = %q, %v; want %q", value, got, ok, want)
		}
	}
}
