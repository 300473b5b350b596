"""A subscriber to a vLLM server's KV event stream (`--kv-events-config`, ZMQ PUB), as
an events-driven router with a central event socket consumes it (it binds, vLLM
connects): vLLM's own decoder (`KVEventBatch`, msgspec) in
the vLLM venv's python, each batch written as a JSON line the test reads.

    sub = KvEventSubscriber(workdir, endpoint).start()
    sub.events()  -> [{"seq", "type", "medium", "block_hashes", "token_ids", "block_size", "extra_keys"}, ...]
"""
from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .processes import stop
from .vllm_engine import vllm_env, vllm_python

_SUBSCRIBER = r"""
import json, sys
import msgspec, zmq
from vllm.distributed.kv_events import KVEventBatch
endpoint, topic, out, mode = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
sock = zmq.Context().socket(zmq.SUB)
sock.setsockopt_string(zmq.SUBSCRIBE, topic)
if mode == "bind":
    sock.bind(endpoint)  # vLLM connects to a non-wildcard tcp endpoint, as to a router's
else:
    sock.connect(endpoint)  # vLLM binds (ipc:// or tcp://*): any number of subscribers dial
decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
with open(out, "a", buffering=1) as f:
    while True:
        _topic, seq, payload = sock.recv_multipart()
        batch = decoder.decode(payload)
        for ev in batch.events:
            row = {"seq": int.from_bytes(seq, "big"), "type": type(ev).__name__}
            for name in ("medium", "block_hashes", "token_ids", "block_size", "extra_keys", "parent_block_hash"):
                if hasattr(ev, name):
                    row[name] = getattr(ev, name)
            f.write(json.dumps(row, default=repr) + "\n")
"""


@dataclass
class KvEventSubscriber:
    workdir: Path
    endpoint: str
    topic: str = ""
    bind: bool = True  # False: dial an endpoint vLLM binds (ipc://), beside other subscribers
    proc: subprocess.Popen | None = None

    @property
    def path(self) -> Path:
        return self.workdir / "kv-events.jsonl"

    def start(self) -> "KvEventSubscriber":
        self.path.write_text("")
        with open(self.workdir / "kv-events.err", "w") as err:  # the child keeps its own copy
            mode = "bind" if self.bind else "connect"
            self.proc = subprocess.Popen([vllm_python(), "-c", _SUBSCRIBER, self.endpoint, self.topic,
                                          str(self.path), mode], env=vllm_env(), stdout=subprocess.DEVNULL, stderr=err)
        return self

    def events(self) -> list[dict]:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"the KV event subscriber exited {self.proc.returncode}: "
                               f"{(self.workdir / 'kv-events.err').read_text()[-2000:]}")
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def close(self) -> None:
        stop(self.proc, 5)


def kv_events_config(endpoint: str, topic: str = "") -> dict:
    """vLLM's --kv-events-config publishing to `endpoint` (tcp://127.0.0.1:PORT: vLLM
    connects, the subscriber binds — a router's central event socket; ipc://PATH: vLLM
    binds and subscribers dial it, as llm-d's per-pod subscribers dial each pod)."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": topic}
