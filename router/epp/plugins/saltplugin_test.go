package plugins

import (
	"context"
	"encoding/json"
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
