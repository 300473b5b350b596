// Command extproc-gateway plays the gateway's part of the ext_proc protocol
// for one request, for tests where no Envoy can be had: it sends the request's
// headers and body to an Endpoint Picker over a real ext_proc stream and
// prints, as one JSON line, the endpoint the EPP chose (the
// x-gateway-destination-endpoint header mutation) and the body it forwards.
//
//	extproc-gateway -addr 127.0.0.1:9002 -H x-tenant-id=acme -body '{"model": ...}'
//
// It is a stand-in for the data plane, not a gateway: it routes nothing.
package main

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extproc "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

type headerFlags []string

func (h *headerFlags) String() string     { return strings.Join(*h, ",") }
func (h *headerFlags) Set(v string) error { *h = append(*h, v); return nil }

type result struct {
	Endpoint  string          `json:"endpoint"`
	Body      json.RawMessage `json:"body,omitempty"`
	RawBody   string          `json:"rawBody,omitempty"`
	Immediate int32           `json:"immediateStatus,omitempty"`
	Detail    string          `json:"immediateBody,omitempty"`
}

func main() {
	addr := flag.String("addr", "127.0.0.1:9002", "the EPP's ext_proc address")
	body := flag.String("body", "", "request body (JSON)")
	path := flag.String("path", "/v1/chat/completions", ":path of the request")
	plaintext := flag.Bool("plaintext", false, "plain gRPC (the EPP's --secure-serving=false); by default TLS "+
		"without verifying the EPP's certificate, as gateways talk to its self-signed one")
	timeout := flag.Duration("timeout", 10*time.Second, "deadline for the exchange")
	var headers headerFlags
	flag.Var(&headers, "H", "request header name=value (repeatable)")
	flag.Parse()
	res, err := exchange(*addr, *path, headers, []byte(*body), *timeout, *plaintext)
	if err != nil {
		fmt.Fprintln(os.Stderr, "extproc-gateway:", err)
		os.Exit(1)
	}
	out, _ := json.Marshal(res)
	fmt.Println(string(out))
}

func exchange(addr, path string, headers []string, body []byte, timeout time.Duration, plaintext bool) (*result, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	creds := credentials.NewTLS(&tls.Config{InsecureSkipVerify: true}) //nolint:gosec // the EPP's self-signed cert
	if plaintext {
		creds = insecure.NewCredentials()
	}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	stream, err := extproc.NewExternalProcessorClient(conn).Process(ctx)
	if err != nil {
		return nil, err
	}
	hs := []*corev3.HeaderValue{
		{Key: ":method", RawValue: []byte("POST")},
		{Key: ":path", RawValue: []byte(path)},
		{Key: ":authority", RawValue: []byte("gateway.local")},
		{Key: "content-type", RawValue: []byte("application/json")},
		{Key: "content-length", RawValue: []byte(fmt.Sprint(len(body)))},
	}
	for _, h := range headers {
		k, v, ok := strings.Cut(h, "=")
		if !ok {
			return nil, fmt.Errorf("header %q: want name=value", h)
		}
		hs = append(hs, &corev3.HeaderValue{Key: strings.ToLower(k), RawValue: []byte(v)})
	}
	if err := stream.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extproc.HttpHeaders{Headers: &corev3.HeaderMap{Headers: hs}},
	}}); err != nil {
		return nil, err
	}
	if err := stream.Send(&extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_RequestBody{
		RequestBody: &extproc.HttpBody{Body: body, EndOfStream: true},
	}}); err != nil {
		return nil, err
	}
	res := &result{}
	var forwarded []byte
	gotHeaders, gotBody := false, false
	for !(gotHeaders && gotBody) {
		resp, err := stream.Recv()
		if err != nil {
			return nil, fmt.Errorf("receive: %w", err)
		}
		switch r := resp.Response.(type) {
		case *extproc.ProcessingResponse_ImmediateResponse:
			res.Immediate = int32(r.ImmediateResponse.GetStatus().GetCode())
			res.Detail = string(r.ImmediateResponse.GetBody())
			return res, nil
		case *extproc.ProcessingResponse_RequestHeaders:
			gotHeaders = true
			for _, o := range r.RequestHeaders.GetResponse().GetHeaderMutation().GetSetHeaders() {
				if o.GetHeader().GetKey() == "x-gateway-destination-endpoint" {
					res.Endpoint = string(o.GetHeader().GetRawValue()) + o.GetHeader().GetValue()
				}
			}
		case *extproc.ProcessingResponse_RequestBody:
			m := r.RequestBody.GetResponse().GetBodyMutation()
			switch {
			case m.GetStreamedResponse() != nil:
				forwarded = append(forwarded, m.GetStreamedResponse().GetBody()...)
				gotBody = m.GetStreamedResponse().GetEndOfStream()
			default:
				forwarded = append(forwarded, m.GetBody()...)
				gotBody = true
			}
		}
	}
	if json.Valid(forwarded) {
		res.Body = forwarded
	} else {
		res.RawBody = string(forwarded)
	}
	return res, nil
}
