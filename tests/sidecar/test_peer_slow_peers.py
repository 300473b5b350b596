"""A slow peer costs its own requests a miss, never anyone else's: while one peer
trickles its answers, a real sidecar keeps serving lookups that other peers hold, and
the trickled fetches end at the sidecar's deadline as misses."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import redis as redis_sync

from kvtier.keys import block_hashes
from kvtier_sidecar.client import EngineHit, Miss, SidecarClient
from kvtier_sidecar.peer_fetch import MAX_FETCHES_PER_PEER

from .slow_peer import TricklingPeer
from .test_sidecar_process import poll, prompt, seed_cache

BB = 8192
# The sidecar's whole-fetch deadline: long against the healthy lookup below (a few
# milliseconds), so "answered while the slow fetches were still trickling" holds on a
# loaded machine too.
DEADLINE_S = 3.0
# More lookups toward the slow peer than the sidecar has request-path fetch threads.
SLOW_LOOKUPS = 8
# The trickle: a byte well inside every socket wait, so only a whole-fetch deadline ends it.
TRICKLE_EVERY_S = DEADLINE_S / 20


def _advertise(redis_url: str, host: str, root, tokens) -> None:
    """Put `host` in the global index as a live member holding every block of `tokens`."""
    r = redis_sync.Redis.from_url(redis_url)
    r.zadd("kvt:members", {host: time.time() + 3600})
    for h in block_hashes(root, tokens, 16):
        r.hset(f"kvt:{{{root.digest().hex()}}}:{h.hex()}", host, int(time.time()) + 600)


def test_a_trickling_peer_costs_its_own_lookups_a_miss_and_others_are_served(
        spawn, oracle, redis_url, secret_file):
    healthy = spawn("healthy", "127.0.0.2", redis_url, secret_file)
    fast_root, fast_tokens = oracle.root("fast"), prompt(200, seed=1)
    seed_cache(SidecarClient(healthy.socket), oracle, "fast", fast_tokens)
    last = block_hashes(fast_root, fast_tokens, 16)[-1].hex()
    index = redis_sync.Redis.from_url(redis_url)
    poll(lambda: index.hexists(f"kvt:{{{fast_root.digest().hex()}}}:{last}", healthy.peer))

    slow = TricklingPeer("127.0.0.5", Path(secret_file).read_bytes().strip(), TRICKLE_EVERY_S)
    slow_root, slow_tokens = oracle.root("slow"), prompt(200, seed=2)
    _advertise(redis_url, slow.address, slow_root, slow_tokens)
    # (a generous index timeout: this test is about peers, not a loaded machine's Redis)
    sc = spawn("sc", "127.0.0.3", redis_url, secret_file, peer_timeout_s=DEADLINE_S,
               index_lookup_timeout_s=DEADLINE_S)

    answers: list = []

    def slow_lookup() -> None:
        answers.append(SidecarClient(sc.socket, timeout_s=10 * DEADLINE_S).lookup(slow_root, slow_tokens))

    threads = [threading.Thread(target=slow_lookup) for _ in range(SLOW_LOOKUPS)]
    for t in threads:
        t.start()
    poll(lambda: slow.active >= MAX_FETCHES_PER_PEER, timeout_s=10 * DEADLINE_S, every_s=0.005)

    # Meanwhile a lookup another peer can serve is a byte-exact peer hit, answered while
    # the slow peer's fetches are still trickling (it did not wait behind them).
    client = SidecarClient(sc.socket, timeout_s=10 * DEADLINE_S)
    hit = client.lookup(fast_root, fast_tokens)
    still_trickling = slow.active
    assert isinstance(hit, EngineHit) and hit.tier == "peer" and hit.matched_tokens == 192, hit
    assert still_trickling > 0, "the healthy lookup waited for the slow peer's fetches to end"
    dst = np.zeros(12 * BB, np.uint8)
    client.materialize(hit, dst)
    assert np.array_equal(dst, oracle.kv(fast_root, fast_tokens)[: 12 * BB])
    client.release(hit)

    # The slow peer's lookups are misses, each ended by the sidecar's deadline, however
    # long the peer would have gone on trickling.
    for t in threads:
        t.join()
    assert len(answers) == SLOW_LOOKUPS and all(isinstance(a, Miss) for a in answers), answers
    poll(lambda: slow.active == 0, timeout_s=10 * DEADLINE_S)
    assert slow.peak <= MAX_FETCHES_PER_PEER
    assert slow.lifetimes_s and max(slow.lifetimes_s) < 2 * DEADLINE_S, slow.lifetimes_s
    stats = sc.stats()["sidecar"]
    assert stats["peer_fetches_shed"] >= SLOW_LOOKUPS - MAX_FETCHES_PER_PEER
    assert sc.proc.poll() is None
    slow.close()


# Authenticated connections the test holds against a sidecar with two peer slots.
SLOW_CLIENTS = 3


def test_authenticated_clients_trickling_a_large_request_do_not_starve_a_real_peer(spawn, oracle, secret_file):
    """Past the handshake a client holds a peer slot; announcing the largest request
    and sending it a byte at a time must not keep it: the server cuts the request at
    its deadline, the slots come back, and a real peer's fetch is served."""
    from kvtier_sidecar import wire
    from kvtier_sidecar.peer_tcp import TcpTransport

    from .test_peer_transport import Sink, _authenticated

    secret = Path(secret_file).read_bytes().strip()
    sc = spawn("sc", "127.0.0.2", None, secret_file, peer_timeout_s=DEADLINE_S, peer_max_concurrency=2)
    root, tokens = oracle.root("t"), prompt(100, seed=3)
    seed_cache(SidecarClient(sc.socket), oracle, "t", tokens)
    lifetimes: list[float] = []
    trickled: list[int] = []
    stop = threading.Event()

    def trickle() -> None:
        s = _authenticated(sc.peer, secret)
        opened = time.monotonic()
        try:
            # A sealed record announcing the largest request, its bytes trickled after.
            s.sendall(wire.RECORD.pack(wire.RECORD_MAGIC, wire.MAX_REQUEST_RECORD_BYTES))
            while not stop.wait(TRICKLE_EVERY_S):
                s.sendall(b"\0")
                trickled.append(1)
        except OSError:
            lifetimes.append(time.monotonic() - opened)  # the server hung up on us
        finally:
            s.close()

    threads = [threading.Thread(target=trickle) for _ in range(SLOW_CLIENTS)]
    for t in threads:
        t.start()
    poll(lambda: len(trickled) >= 3 * SLOW_CLIENTS)  # the tricklers hold the slots now
    transport = TcpTransport(secret, connect_timeout_s=DEADLINE_S, timeout_s=DEADLINE_S, identity="127.0.0.9:1")
    kv = oracle.kv(root, tokens)
    outcomes = []
    deadline = time.monotonic() + 10 * DEADLINE_S
    while time.monotonic() < deadline:
        sink = Sink()
        out = transport.fetch(sc.peer, root, tokens, 16, BB, sink, max_blocks=6)
        outcomes.append(out.error)
        if out.error is None:
            break
        time.sleep(TRICKLE_EVERY_S)
    assert "busy" in outcomes, outcomes[:5]  # the tricklers held every slot at first...
    assert outcomes[-1] is None and out.verified_blocks == 6, outcomes[-5:]  # ...not for long
    assert np.array_equal(sink.buf[: 6 * BB], kv[: 6 * BB])
    poll(lambda: len(lifetimes) == SLOW_CLIENTS, timeout_s=10 * DEADLINE_S)  # every trickler was cut...
    assert max(lifetimes) < 2 * DEADLINE_S, lifetimes  # ...by the server's deadline, not by giving up
    stop.set()
    for t in threads:
        t.join()
    assert sc.proc.poll() is None


def test_a_replayed_record_is_refused_and_counted_by_a_sidecar(spawn, oracle, secret_file):
    """The operator sees tampering: a sealed record replayed at a real sidecar ends
    the connection and shows in its stats (and so in /metrics)."""
    from kvtier_sidecar import wire

    from .test_peer_transport import _hung_up, _sealed_reply, _session

    secret = Path(secret_file).read_bytes().strip()
    sc = spawn("sc", "127.0.0.2", None, secret_file)
    seed_cache(SidecarClient(sc.socket), oracle, "t", prompt(100, seed=4))
    s, session = _session(sc.peer, secret)
    record = session.seal(wire.encode_request(
        wire.Op.HOT, wire.HotRequest(tenant="t", max_bytes=1 << 20).model_dump_json().encode()))
    s.sendall(record)
    status, body = _sealed_reply(s, session)
    assert status is wire.Status.OK and wire.HotResponse.model_validate_json(body).prefixes
    assert sc.stats()["sidecar"].get("peer_bad_records", 0) == 0
    s.sendall(record)
    assert _hung_up(s)
    poll(lambda: sc.stats()["sidecar"].get("peer_bad_records") == 1)
    s.close()
    assert sc.proc.poll() is None
