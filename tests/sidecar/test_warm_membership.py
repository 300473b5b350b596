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
    status, body = b.post("/cache/warm", {"tenant": "victim", "from_peer": fake_address, "max_bytes": 1 << 20})
    assert status == 403 and "not a member" in json.loads(body)["error"]
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
