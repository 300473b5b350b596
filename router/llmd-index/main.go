// Command llmd-index runs llm-d's precise prefix-cache producer, unmodified, as the llm-d
// router runs it: llm-d-kv-cache's KV-event pool (its ZMQ subscriber, its vLLM engine
// adapter, its in-memory block index, its token processor) fed by a vLLM server's
// `--kv-events-config` stream, and its longest-prefix scorer with per-tier weights. A
// loopback HTTP endpoint asks the index what a router would ask it, so tests can check
// what a real events-driven router learns from kvtier's events (medium KVTIER, which
// llm-d files under the device tier "kvtier").
//
//	llmd-index --events ipc:///run/vllm-events.sock --listen 127.0.0.1:8088 \
//	    --block-size 16 --tiers gpu=1.0,kvtier=0.8
//
//	POST /score {"model": "m", "tokens": [...], "cache_salt": "tenant-a"}
//	  -> {"blocks": [[{"pod": "p", "tier": "kvtier"}, ...], ...], "scores": {"p": 9.6}}
//
// "blocks" lists, for each whole block of the prompt (as llm-d keys it), the pods and
// tiers llm-d's index holds for it; "scores" is llm-d's LongestPrefix score per pod.
//
// cache_salt: vLLM's events carry a request's cache_salt in the first block's extra
// keys, a bare string, which llm-d-kv-cache v0.9.0's parser takes for a multimodal
// identifier and folds into that block's key. Its own scorer builds a request's keys
// from multimodal data only, so it never finds a salted prompt (llm-d-router#1389); a
// query here with the salt folds it in the way the index did, to ask what the index
// holds for that tenant's prefix.
// This is a test instrument (it has no authentication), and it listens on loopback only.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/llm-d/llm-d-kv-cache/pkg/kvcache"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvcache/kvblock"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents/engineadapter"
	"go.uber.org/zap/zapcore"
	"k8s.io/apimachinery/pkg/util/sets"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
)

type scoreRequest struct {
	Model     string   `json:"model"`
	Tokens    []uint32 `json:"tokens"`
	CacheSalt string   `json:"cache_salt,omitempty"`
}

type holder struct {
	Pod  string `json:"pod"`
	Tier string `json:"tier"`
}

type scoreResponse struct {
	Blocks [][]holder         `json:"blocks"`
	Scores map[string]float64 `json:"scores"`
}

type server struct {
	blockSize int
	index     kvblock.Index
	processor kvblock.TokenProcessor
	scorer    kvcache.KVBlockScorer
}

func (s *server) score(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		http.Error(w, "POST a JSON body {model, tokens}", http.StatusMethodNotAllowed)
		return
	}
	var req scoreRequest
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, 8<<20))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil || req.Model == "" {
		http.Error(w, "the body must be JSON {\"model\": string, \"tokens\": [uint32]}", http.StatusBadRequest)
		return
	}
	ctx := r.Context()
	out := scoreResponse{Blocks: [][]holder{}, Scores: map[string]float64{}}
	var extra []*kvblock.BlockExtraFeatures
	if blocks := len(req.Tokens) / s.blockSize; req.CacheSalt != "" && blocks > 0 {
		// As kvblock.ParseRawExtraKeys files vLLM's extra_keys [[salt], nil, ...].
		extra = make([]*kvblock.BlockExtraFeatures, blocks)
		extra[0] = &kvblock.BlockExtraFeatures{MMHashes: []kvblock.MMHash{{Hash: req.CacheSalt}}}
	}
	keys, err := s.processor.TokensToKVBlockKeys(kvblock.EmptyBlockHash, req.Tokens, req.Model, extra)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	if len(keys) > 0 {
		found, err := s.index.Lookup(ctx, keys, sets.New[string]())
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		for _, key := range keys {
			held := []holder{}
			for _, e := range found[key] {
				held = append(held, holder{Pod: e.PodIdentifier, Tier: e.DeviceTier})
			}
			sort.Slice(held, func(i, j int) bool {
				return held[i].Pod+"\x00"+held[i].Tier < held[j].Pod+"\x00"+held[j].Tier
			})
			out.Blocks = append(out.Blocks, held)
		}
		if out.Scores, err = s.scorer.Score(ctx, keys, found); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(out)
}

// parseTiers reads "gpu=1.0,kvtier=0.8" into llm-d's backend configs.
func parseTiers(spec string) ([]*kvcache.KVCacheBackendConfig, error) {
	var tiers []*kvcache.KVCacheBackendConfig
	for _, part := range strings.Split(spec, ",") {
		name, weight, ok := strings.Cut(strings.TrimSpace(part), "=")
		w, err := strconv.ParseFloat(weight, 64)
		if !ok || name == "" || err != nil {
			return nil, fmt.Errorf("--tiers: %q is not name=weight", part)
		}
		tiers = append(tiers, &kvcache.KVCacheBackendConfig{Name: name, Weight: w})
	}
	return tiers, nil
}

func main() {
	events := flag.String("events", "", "the vLLM KV event stream to subscribe to (ipc:// or tcp://host:port)")
	bind := flag.Bool("bind", false, "bind the events endpoint (llm-d's central socket, vLLM connects) instead of dialing it")
	listen := flag.String("listen", "127.0.0.1:0", "loopback address of the query endpoint")
	blockSize := flag.Int("block-size", 16, "tokens per block (vLLM's --block-size)")
	hashSeed := flag.String("hash-seed", "", "llm-d's token-processor hash seed")
	tierSpec := flag.String("tiers", "gpu=1.0,cpu=0.8,kvtier=0.8", "scoring weight per device tier (llm-d's kvCacheBackendConfigs)")
	verbosity := flag.Int("v", 0, "llm-d's log verbosity (its DEBUG is 4, TRACE 5)")
	flag.Parse()
	ctrllog.SetLogger(zap.New(zap.Level(zapcore.Level(-*verbosity))))
	if *events == "" {
		log.Fatal("--events is required")
	}
	host, _, err := net.SplitHostPort(*listen)
	if err != nil || !net.ParseIP(host).IsLoopback() {
		log.Fatalf("--listen %q: a loopback host:port is required (this instrument has no authentication)", *listen)
	}
	tiers, err := parseTiers(*tierSpec)
	if err != nil {
		log.Fatal(err)
	}

	index, err := kvblock.NewInMemoryIndex(&kvblock.InMemoryIndexConfig{Size: 1 << 20, PodCacheSize: 16})
	if err != nil {
		log.Fatal(err)
	}
	processor, err := kvblock.NewChunkedTokenDatabase(&kvblock.TokenProcessorConfig{BlockSize: *blockSize, HashSeed: *hashSeed})
	if err != nil {
		log.Fatal(err)
	}
	scorer, err := kvcache.NewKVBlockScorer(&kvcache.KVBlockScorerConfig{
		ScoringStrategy: kvcache.LongestPrefixMatch, BackendConfigs: tiers})
	if err != nil {
		log.Fatal(err)
	}
	adapter, err := engineadapter.NewAdapter("vllm")
	if err != nil {
		log.Fatal(err)
	}

	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer cancel()
	cfg := kvevents.DefaultConfig()
	cfg.DiscoverPods = false
	pool := kvevents.NewPool(cfg, index, processor, adapter)
	pool.Start(ctx)
	subscribers := kvevents.NewSubscriberManager(pool)
	if err := subscribers.EnsureSubscriber(ctx, "vllm", *events, cfg.TopicFilter, !*bind); err != nil {
		log.Fatal(err)
	}

	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		log.Fatal(err)
	}
	mux := http.NewServeMux()
	srv := &server{blockSize: *blockSize, index: index, processor: processor, scorer: scorer}
	mux.HandleFunc("/score", srv.score)
	mux.HandleFunc("/alive", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	httpServer := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	// The address on stdout's first line: the caller reads the port it got.
	fmt.Printf("listening http://%s\n", ln.Addr())
	_ = os.Stdout.Sync()
	go func() {
		<-ctx.Done()
		shutdown, done := context.WithTimeout(context.Background(), 2*time.Second)
		defer done()
		_ = httpServer.Shutdown(shutdown)
	}()
	if err := httpServer.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		log.Fatal(err)
	}
	subscribers.Shutdown(context.Background())
	pool.Shutdown(context.Background())
}
