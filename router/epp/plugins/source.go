package plugins

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvtier/kvtier/router/affinity"
)

// tableSource holds the newest good affinity table read from a file (the
// ConfigMap's table.json mounted in the EPP's pod) and, optionally, Redis (the
// operator's hint, usually fresher). A read that fails or decodes to a bad table
// changes nothing: routing goes on from the last good table. Each source's
// newest read replaces that source's table (an operator that starts its epochs
// over is followed); of the two sources' tables the higher epoch wins.
type tableSource struct {
	path          string
	checkInterval time.Duration
	redis         *redisReader // nil: no Redis

	fromFile, fromRedis atomic.Pointer[affinity.Table]

	mu        sync.Mutex // guards the file check below
	lastCheck time.Time
	lastData  []byte
	lastErr   string
}

func newTableSource(path string, checkInterval time.Duration, redis *redisReader) *tableSource {
	return &tableSource{path: path, checkInterval: checkInterval, redis: redis}
}

// Table is the newest good table, nil if none was ever read. It re-reads the
// file at most once per checkInterval, and never makes a request wait for
// another request's read.
func (s *tableSource) Table() *affinity.Table {
	if s.path != "" && s.mu.TryLock() {
		if time.Since(s.lastCheck) >= s.checkInterval || s.lastCheck.IsZero() {
			s.lastCheck = time.Now()
			s.checkFile()
		}
		s.mu.Unlock()
	}
	f, r := s.fromFile.Load(), s.fromRedis.Load()
	if f == nil || (r != nil && r.Epoch() > f.Epoch()) {
		return r
	}
	return f
}

// checkFile reads the file; called with mu held.
func (s *tableSource) checkFile() {
	data, err := os.ReadFile(s.path)
	if err != nil {
		s.noteErr(fmt.Sprintf("read %s: %v (routing on the last good table)", s.path, err))
		return
	}
	if bytes.Equal(data, s.lastData) {
		return
	}
	t, err := affinity.Decode(data)
	if err != nil {
		s.noteErr(fmt.Sprintf("%s: %v (routing on the last good table)", s.path, err))
		return
	}
	s.lastData = data
	s.lastErr = ""
	s.fromFile.Store(t)
}

func (s *tableSource) noteErr(msg string) {
	if msg != s.lastErr {
		s.lastErr = msg
		logf("%s", msg)
	}
}

// LastError is the last file read's failure ("" when the last read was good).
func (s *tableSource) LastError() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lastErr
}

// runRedis polls the Redis key until ctx ends; each good table is offered.
func (s *tableSource) runRedis(ctx context.Context) {
	if s.redis == nil {
		return
	}
	var last []byte
	lastErr := ""
	tick := time.NewTicker(s.redis.interval)
	defer tick.Stop()
	for {
		data, err := s.redis.get(ctx)
		switch {
		case err != nil:
			if msg := err.Error(); msg != lastErr {
				lastErr = msg
				logf("redis: %v (routing on the last good table)", err)
			}
		case !bytes.Equal(data, last):
			t, err := decodeRedisPayload(data)
			if err != nil {
				logf("redis key %s: %v (routing on the last good table)", s.redis.key, err)
				break
			}
			last, lastErr = data, ""
			s.fromRedis.Store(t)
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// decodeRedisPayload reads the operator's Redis value: {"table": {...}, "addresses": {...}}
// (operator/kvtier_operator/publish.py).
func decodeRedisPayload(data []byte) (*affinity.Table, error) {
	var payload struct {
		Table json.RawMessage `json:"table"`
	}
	if err := json.Unmarshal(data, &payload); err != nil {
		return nil, fmt.Errorf("not the operator's payload: %v", err)
	}
	if len(payload.Table) == 0 {
		return nil, fmt.Errorf("payload has no table")
	}
	return affinity.Decode(payload.Table)
}
