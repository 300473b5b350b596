"""`POST /cache/warm` dials only the sidecar's own fleet, never an address a caller names."""
import json
import socket

from .test_sidecar_process import poll


def test_warm_from_an_address_outside_the_fleet_is_refused_and_never_dialled(spawn, redis_url, secret_file):
    a = spawn("a", "127.0.0.2", redis_url, secret_file)
    b = spawn("b", "127.0.0.3", redis_url, secret_file)
    fake = socket.create_server(("127.0.0.9", 0))
    fake.settimeout(0.0)
    fake_address = "127.0.0.9:%d" % fake.getsockname()[1]
    # While b's member set may still be filling (b only just joined) the answer is 503,
    # ask again; once settled, a plain 403. Never accepted either way.
    answers = []
    poll(lambda: answers.append(b.post("/cache/warm", {"tenant": "victim", "from_peer": fake_address,
                                                       "max_bytes": 1 << 20})) or answers[-1][0] == 403,
         timeout_s=30, every_s=0.5)
    assert {status for status, _ in answers} <= {503, 403}, answers
    assert "not a member" in json.loads(answers[-1][1])["error"]
    assert json.loads(b.get("/cache/jobs")[1]) == {}
    try:
        fake.accept()
        dialled = True
    except BlockingIOError:
        dialled = False
    assert not dialled
    # A member of the same index is accepted (once its heartbeat is in Redis).
    poll(lambda: b.post("/cache/warm", {"tenant": "t", "from_peer": a.peer, "max_bytes": 1 << 20})[0] == 202)
    fake.close()


def test_warm_peers_from_config_are_the_only_sources_without_an_index(spawn, secret_file):
    a = spawn("a", "127.0.0.2", None, secret_file)
    b = spawn("b", "127.0.0.3", None, secret_file, warm_peers=[a.peer])
    assert b.post("/cache/warm", {"tenant": "t", "from_peer": a.peer, "max_bytes": 1 << 20})[0] == 202
    status, body = b.post("/cache/warm", {"tenant": "t", "from_peer": "127.0.0.9:1", "max_bytes": 1 << 20})
    assert status == 403



def warm_answer(side, peer: str, ref: str) -> tuple[int, dict[str, str], dict]:
    status, headers, raw = side.control.exchange(
        "POST", "/cache/warm", {"tenant": "t", "from_peer": peer, "max_bytes": 1 << 20, "ref": ref})
    return status, headers, json.loads(raw)


def jobs(side) -> dict:
    return json.loads(side.get("/cache/jobs")[1])


def test_a_source_the_index_cannot_confirm_while_redis_is_down_is_asked_again_later_not_refused(
        spawn, redis_server_fn, secret_file):
    a = spawn("a", "127.0.0.2", redis_server_fn.url, secret_file)
    b = spawn("b", "127.0.0.3", redis_server_fn.url, secret_file)
    poll(lambda: warm_answer(b, a.peer, "before")[0] == 202)  # a's heartbeat is in Redis
    started = set(jobs(b))
    redis_server_fn.kill()
    status, headers, body = warm_answer(b, a.peer, "during")  # neither yes nor no while Redis is away
    assert status == 503 and int(headers["Retry-After"]) >= 1 and "retry later" in body["error"], (status, body)
    assert set(jobs(b)) == started  # nothing started, nothing dialled
    redis_server_fn.start()  # empty: a's next heartbeat makes it a member again
    poll(lambda: warm_answer(b, a.peer, "during")[0] == 202, timeout_s=30)
    # Back, and settled: a stranger is refused again (503 only while the set refills).
    poll(lambda: warm_answer(b, "127.0.0.9:1", "stranger")[0] == 403, timeout_s=30, every_s=0.5)
