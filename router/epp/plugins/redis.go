package plugins

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// redisReader GETs one key over RESP: a connection per poll, AUTH and SELECT
// from the URL (redis://[user:password@]host:port[/db]). It keeps the EPP free
// of a Redis client dependency; the operator writes the key with SET and
// nothing here needs more than GET.
type redisReader struct {
	addr, user, password string
	db                   int
	key                  string
	interval, timeout    time.Duration
}

func newRedisReader(rawURL, key string, interval time.Duration) (*redisReader, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return nil, fmt.Errorf("redisUrl: %v", err)
	}
	if u.Scheme != "redis" {
		return nil, fmt.Errorf("redisUrl: scheme %q, want redis:// (TLS is not supported)", u.Scheme)
	}
	r := &redisReader{addr: u.Host, key: key, interval: interval, timeout: 2 * time.Second}
	if u.Port() == "" {
		r.addr = net.JoinHostPort(u.Hostname(), "6379")
	}
	if u.User != nil {
		r.password, _ = u.User.Password()
		r.user = u.User.Username()
		if _, ok := u.User.Password(); !ok { // redis://secret@host: the name is the password
			r.user, r.password = "", u.User.Username()
		}
	}
	if db := strings.TrimPrefix(u.Path, "/"); db != "" {
		if r.db, err = strconv.Atoi(db); err != nil {
			return nil, fmt.Errorf("redisUrl: database %q is not a number", db)
		}
	}
	return r, nil
}

var errNoKey = errors.New("key not set")

func (r *redisReader) get(ctx context.Context) ([]byte, error) {
	d := net.Dialer{Timeout: r.timeout}
	conn, err := d.DialContext(ctx, "tcp", r.addr)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(r.timeout))
	rd := bufio.NewReader(conn)
	cmds := [][]string{}
	if r.password != "" {
		if r.user != "" {
			cmds = append(cmds, []string{"AUTH", r.user, r.password})
		} else {
			cmds = append(cmds, []string{"AUTH", r.password})
		}
	}
	if r.db != 0 {
		cmds = append(cmds, []string{"SELECT", strconv.Itoa(r.db)})
	}
	cmds = append(cmds, []string{"GET", r.key})
	var out []byte
	for _, c := range cmds {
		if _, err := conn.Write(encodeCommand(c)); err != nil {
			return nil, err
		}
		if out, err = readReply(rd); err != nil {
			return nil, fmt.Errorf("%s: %w", c[0], err)
		}
	}
	if out == nil {
		return nil, fmt.Errorf("%s: %w", r.key, errNoKey)
	}
	return out, nil
}

func encodeCommand(args []string) []byte {
	var b strings.Builder
	fmt.Fprintf(&b, "*%d\r\n", len(args))
	for _, a := range args {
		fmt.Fprintf(&b, "$%d\r\n%s\r\n", len(a), a)
	}
	return []byte(b.String())
}

// readReply reads one reply: a bulk string's bytes, nil for a nil bulk, an
// empty slice for a simple string or integer, an error for an error reply.
func readReply(rd *bufio.Reader) ([]byte, error) {
	line, err := rd.ReadString('\n')
	if err != nil {
		return nil, err
	}
	line = strings.TrimRight(line, "\r\n")
	if line == "" {
		return nil, errors.New("empty reply")
	}
	switch line[0] {
	case '+', ':':
		return []byte{}, nil
	case '-':
		return nil, errors.New(line[1:])
	case '$':
		n, err := strconv.Atoi(line[1:])
		if err != nil {
			return nil, fmt.Errorf("bad bulk length %q", line)
		}
		if n < 0 {
			return nil, nil
		}
		buf := make([]byte, n+2)
		if _, err := io.ReadFull(rd, buf); err != nil {
			return nil, err
		}
		return buf[:n], nil
	default:
		return nil, fmt.Errorf("unexpected reply %q", line)
	}
}

func bufioReader(conn net.Conn) *bufio.Reader { return bufio.NewReader(conn) }
