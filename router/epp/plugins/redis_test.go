package plugins

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// startRedis runs a real redis-server on a free port; fails where there is none
// (scripts/setup.sh installs it).
func startRedis(t *testing.T, extra ...string) (addr string, stop func()) {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		t.Fatal("redis-server not installed: run scripts/setup.sh")
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	cmd := exec.Command(bin, "--port", fmt.Sprint(port), "--bind", "127.0.0.1", "--save", "",
		"--appendonly", "no", "--dir", t.TempDir())
	cmd.Args = append(cmd.Args, extra...)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	stop = func() {
		select {
		case <-done:
		default:
			_ = cmd.Process.Kill()
			<-done
		}
	}
	t.Cleanup(stop)
	addr = fmt.Sprintf("127.0.0.1:%d", port)
	waitFor(t, 10*time.Second, "redis-server to answer PING", func() bool {
		_, err := redisDo(addr, "PING")
		return err == nil || strings.Contains(err.Error(), "NOAUTH")
	})
	return addr, stop
}

func redisDo(addr string, args ...string) ([]byte, error) {
	return redisDoAuth(addr, "", args...)
}

func redisDoAuth(addr, password string, args ...string) ([]byte, error) {
	c := redis.NewClient(&redis.Options{Addr: addr, Password: password, DialTimeout: time.Second, ReadTimeout: 2 * time.Second,
		WriteTimeout: 2 * time.Second, MaxRetries: -1})
	defer c.Close()
	cmd := make([]any, len(args))
	for i, a := range args {
		cmd[i] = a
	}
	v, err := c.Do(context.Background(), cmd...).Result()
	if err != nil {
		return nil, err
	}
	return []byte(fmt.Sprint(v)), nil
}

func waitFor(t *testing.T, limit time.Duration, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", limit, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func redisPayload(table string) string {
	b, _ := json.Marshal(map[string]any{"table": json.RawMessage(table), "addresses": map[string]any{}})
	return string(b)
}

// The operator's Redis copy is followed, the higher epoch of file and Redis
// wins, and with Redis killed routing goes on from the last table it gave.
func TestScorerFollowsRedisAndSurvivesItsDeath(t *testing.T) {
	addr, stop := startRedis(t)
	key := "kvt:affinity:ns:policy"
	path := filepath.Join(t.TempDir(), "table.json")
	writeFile(t, path, table3(1, "pod-a"))
	s := newScorer(t, AffinityParameters{TablePath: path, RedisURL: "redis://" + addr, RedisKey: key, RedisInterval: "20ms"})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go s.source.runRedis(ctx)

	acme := func() string { return top(t, s.Score(context.Background(), nil, tenantRequest("acme"), pods3())) }
	if got := acme(); got != "pod-a" {
		t.Fatalf("Redis key unset: acme went to %q, the file says pod-a", got)
	}
	if _, err := redisDo(addr, "SET", key, redisPayload(table3(2, "pod-b"))); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the Redis table (epoch 2) to route acme to pod-b", func() bool { return acme() == "pod-b" })

	// A bad value in Redis changes nothing.
	if _, err := redisDo(addr, "SET", key, `{"table": {"members": {"pod-a": 0}}}`); err != nil {
		t.Fatal(err)
	}
	if _, err := redisDo(addr, "SET", key, "not json"); err != nil {
		t.Fatal(err)
	}
	// The file moving past Redis's epoch wins.
	writeFile(t, path, table3(3, "pod-c"))
	if got := acme(); got != "pod-c" {
		t.Fatalf("file at epoch 3 over Redis at 2: acme went to %q, want pod-c", got)
	}
	if _, err := redisDo(addr, "SET", key, redisPayload(table3(4, "pod-a"))); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the Redis table (epoch 4) to route acme to pod-a", func() bool { return acme() == "pod-a" })

	stop() // Redis killed
	if _, err := redisDo(addr, "PING"); err == nil {
		t.Fatal("redis still answers after it was killed")
	}
	for i := 0; i < 5; i++ {
		if got := acme(); got != "pod-a" {
			t.Fatalf("Redis down: acme went to %q, want pod-a from the last table Redis gave", got)
		}
		time.Sleep(30 * time.Millisecond) // let the poller fail a few times between requests
	}
}

func TestRedisURLParsing(t *testing.T) {
	r, err := newRedisReader("redis://:pw@h:7000/2", "k", time.Second)
	if err != nil || r.addr != "h:7000" || r.password != "pw" || r.user != "" || r.db != 2 {
		t.Fatalf("%+v %v", r, err)
	}
	r, err = newRedisReader("redis://u:pw@h", "k", time.Second)
	if err != nil || r.addr != "h:6379" || r.user != "u" || r.password != "pw" || r.db != 0 {
		t.Fatalf("%+v %v", r, err)
	}
	if _, err := newRedisReader("redis://h/x", "k", time.Second); err == nil {
		t.Fatal("a non-numeric database was accepted")
	}
}

// redisPasswordFile: the password comes from the file (a mounted Secret), and a
// rotated Secret is followed: the file is re-read before each poll.
func TestRedisPasswordFileIsReadAndFollowed(t *testing.T) {
	addr, _ := startRedis(t, "--requirepass", "first")
	key := "kvt:affinity:ns:policy"
	dir := t.TempDir()
	path, secret := filepath.Join(dir, "table.json"), filepath.Join(dir, "password")
	writeFile(t, path, table3(1, "pod-a"))
	writeFile(t, secret, "first\n") // a Secret made from `echo first > password`
	if _, err := redisDoAuth(addr, "first", "SET", key, redisPayload(table3(2, "pod-b"))); err != nil {
		t.Fatal(err)
	}
	s := newScorer(t, AffinityParameters{TablePath: path, RedisURL: "redis://" + addr, RedisKey: key,
		RedisPasswordFile: secret, RedisInterval: "20ms"})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go s.source.runRedis(ctx)
	acme := func() string { return top(t, s.Score(context.Background(), nil, tenantRequest("acme"), pods3())) }
	waitFor(t, 10*time.Second, "the Redis table (epoch 2, read with the file's password) to route acme to pod-b",
		func() bool { return acme() == "pod-b" })

	// Rotation: the Secret's file changes, Redis takes only the new password and
	// drops its clients; the next polls authenticate with the new one.
	writeFile(t, secret, "second")
	if _, err := redisDoAuth(addr, "first", "CONFIG", "SET", "requirepass", "second"); err != nil {
		t.Fatal(err)
	}
	if _, err := redisDoAuth(addr, "second", "CLIENT", "KILL", "TYPE", "normal"); err != nil {
		t.Fatal(err)
	}
	if _, err := redisDoAuth(addr, "second", "SET", key, redisPayload(table3(3, "pod-c"))); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the Redis table (epoch 3, read with the rotated password) to route acme to pod-c",
		func() bool { return acme() == "pod-c" })
}

// A password in the URL and a password file, a missing file, or a file
// without a URL: configuration errors at start, never a request's.
func TestRedisPasswordFileConfigurationErrors(t *testing.T) {
	secret := filepath.Join(t.TempDir(), "password")
	writeFile(t, secret, "pw")
	for _, c := range []struct {
		p    AffinityParameters
		want string
	}{
		{AffinityParameters{RedisURL: "redis://:pw@h:6379", RedisKey: "k", RedisPasswordFile: secret}, "give one of them"},
		{AffinityParameters{RedisURL: "redis://pw@h:6379", RedisKey: "k", RedisPasswordFile: secret}, "give one of them"},
		{AffinityParameters{RedisURL: "redis://h:6379", RedisKey: "k", RedisPasswordFile: secret + ".missing"}, "redisPasswordFile"},
		{AffinityParameters{RedisPasswordFile: secret}, "redisPasswordFile needs redisUrl"},
	} {
		if _, err := NewAffinityScorer(c.p); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: error %v, want one saying %q", c.p, err, c.want)
		}
	}
	r, err := newRedisReaderWithPasswordFile("redis://u@h:7000", "k", time.Second, "")
	if err != nil || r.password != "u" {
		t.Fatalf("%+v %v", r, err)
	}
	r, err = newRedisReaderWithPasswordFile("redis://h:7000", "k", time.Second, secret)
	if err != nil || r.password != "pw" || r.opts.Password != "pw" {
		t.Fatalf("%+v %v", r, err)
	}
}
