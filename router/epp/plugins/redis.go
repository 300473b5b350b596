package plugins

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"time"

	"github.com/redis/go-redis/v9"
)

// redisReader GETs the operator's affinity-table key (the operator writes it
// with SET) with go-redis: AUTH and SELECT from the URL
// (redis://[user:password@]host:port[/db]).
type redisReader struct {
	addr, user, password string
	db                   int
	key                  string
	interval, timeout    time.Duration
	client               *redis.Client
}

func newRedisReader(rawURL, key string, interval time.Duration) (*redisReader, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return nil, fmt.Errorf("redisUrl: %v", err)
	}
	if u.Scheme != "redis" {
		return nil, fmt.Errorf("redisUrl: scheme %q, want redis:// (TLS is not supported)", u.Scheme)
	}
	opts, err := redis.ParseURL(rawURL)
	if err != nil {
		return nil, fmt.Errorf("redisUrl: %v", err)
	}
	if u.User != nil {
		if _, ok := u.User.Password(); !ok { // redis://secret@host: the name is the password
			opts.Username, opts.Password = "", u.User.Username()
		}
	}
	timeout := 2 * time.Second
	opts.DialTimeout, opts.ReadTimeout, opts.WriteTimeout = timeout, timeout, timeout
	opts.PoolSize, opts.MaxRetries = 1, -1 // one poller; a failed poll is retried by the next tick
	return &redisReader{addr: opts.Addr, user: opts.Username, password: opts.Password, db: opts.DB, key: key,
		interval: interval, timeout: timeout, client: redis.NewClient(opts)}, nil
}

var errNoKey = errors.New("key not set")

func (r *redisReader) get(ctx context.Context) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, r.timeout)
	defer cancel()
	out, err := r.client.Get(ctx, r.key).Bytes()
	if errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("%s: %w", r.key, errNoKey)
	}
	if err != nil {
		return nil, fmt.Errorf("GET: %w", err)
	}
	return out, nil
}
