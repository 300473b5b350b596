package plugins

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"time"

	"github.com/redis/go-redis/v9"
)

// redisReader GETs the operator's affinity-table key (the operator writes it
// with SET) with go-redis: AUTH and SELECT from the URL
// (redis://[user:password@]host:port[/db]), or the password from a file (a
// mounted Secret) that is re-read before each poll.
type redisReader struct {
	addr, user, password string
	db                   int
	key                  string
	interval, timeout    time.Duration
	client               *redis.Client

	opts         *redis.Options
	passwordFile string // "" for none
	passwordData []byte // the file's content the client was made with
	passwordErr  string // the last failed re-read, logged once
}

func newRedisReader(rawURL, key string, interval time.Duration) (*redisReader, error) {
	return newRedisReaderWithPasswordFile(rawURL, key, interval, "")
}

// newRedisReaderWithPasswordFile: the password comes from passwordFile (a
// mounted Secret's key) when it is set; the URL must then carry none (two
// sources of one password are a configuration error), and the file must be
// readable at start.
func newRedisReaderWithPasswordFile(rawURL, key string, interval time.Duration, passwordFile string) (*redisReader, error) {
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
	r := &redisReader{addr: opts.Addr, user: opts.Username, password: opts.Password, db: opts.DB, key: key,
		interval: interval, timeout: timeout, opts: opts, passwordFile: passwordFile}
	if passwordFile != "" {
		if opts.Password != "" {
			return nil, fmt.Errorf("redisUrl carries a password and redisPasswordFile is set: give one of them")
		}
		data, err := os.ReadFile(passwordFile)
		if err != nil {
			return nil, fmt.Errorf("redisPasswordFile: %v", err)
		}
		r.setPassword(data)
	}
	r.client = redis.NewClient(r.opts)
	return r, nil
}

// setPassword takes the password file's content (a trailing newline is not
// part of the password: `echo pw > file` and Secrets made from such files).
func (r *redisReader) setPassword(data []byte) {
	r.passwordData = data
	r.password = string(bytes.TrimRight(data, "\r\n"))
	r.opts.Password = r.password
}

// refreshPassword re-reads the password file; a changed password replaces the
// client (the kubelet updates a mounted Secret in place when it is rotated). A
// failed read keeps the last password.
func (r *redisReader) refreshPassword() {
	if r.passwordFile == "" {
		return
	}
	data, err := os.ReadFile(r.passwordFile)
	if err != nil {
		if msg := err.Error(); msg != r.passwordErr {
			r.passwordErr = msg
			logf("redisPasswordFile: %v (keeping the last password)", err)
		}
		return
	}
	r.passwordErr = ""
	if bytes.Equal(data, r.passwordData) {
		return
	}
	r.setPassword(data)
	old := r.client
	r.client = redis.NewClient(r.opts)
	_ = old.Close()
}

var errNoKey = errors.New("key not set")

func (r *redisReader) get(ctx context.Context) ([]byte, error) {
	r.refreshPassword()
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
