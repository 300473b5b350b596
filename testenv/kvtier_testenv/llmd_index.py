"""llm-d's precise prefix-cache producer, the real one (router/llmd-index, built by
`hack/llmd-index.sh`: llm-d-kv-cache's KV-event pool, vLLM adapter, in-memory block
index and longest-prefix scorer, unmodified), subscribed to a vLLM server's KV event
stream, and asked over loopback what an events-driven router would ask it.

    index = LlmdIndex(workdir, "ipc:///.../events.sock", block_size=16).start()
    index.score("model", tokens, "tenant") -> {"blocks": [[{"pod", "tier"}, ...], ...], "scores": {pod: float}}

llm-d takes the pod and the model from the stream's topic (`kv@<pod>@<model>`: see
`topic`) and files each event under its `medium`, lower-cased, as the device tier —
kvtier's events under "kvtier". It keys a block stored with a cache_salt apart from the
same tokens unsalted (router/llmd-index/main.go says how), so queries name the salt.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .control_client import post_json
from .polling import wait_for
from .processes import stop

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "hack" / "llmd-index.sh"
BIN_ENV = "KVTIER_LLMD_INDEX"
TOPIC_PREFIX = "kv@"  # llm-d's subscribers filter on it


class LlmdIndexMissing(RuntimeError):
    """router/llmd-index has not been built for the current sources."""


def topic(pod: str, model: str) -> str:
    """The topic a vLLM server publishes under so llm-d files its events under `pod`."""
    return f"{TOPIC_PREFIX}{pod}@{model}"


@functools.cache
def binary() -> Path:
    explicit = os.environ.get(BIN_ENV)
    if explicit:
        path = Path(explicit)
    else:
        out = subprocess.run(["bash", str(BUILD_SCRIPT), "--print-bin"], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise LlmdIndexMissing(f"{BUILD_SCRIPT} --print-bin failed ({out.returncode}): {out.stderr.strip()}")
        path = Path(out.stdout.strip())
    if not os.access(path, os.X_OK):
        raise LlmdIndexMissing(f"{path} is not built for the current router/llmd-index sources: run "
                               f"scripts/setup.sh (or hack/llmd-index.sh), or point {BIN_ENV} at the binary")
    return path


@dataclass
class LlmdIndex:
    workdir: Path
    events: str  # the vLLM stream: ipc://... (vLLM binds, this dials)
    block_size: int
    tiers: str = "gpu=1.0,cpu=0.8,kvtier=0.8"
    proc: subprocess.Popen | None = None
    url: str = ""

    def start(self) -> "LlmdIndex":
        log = open(self.workdir / "llmd-index.log", "w")
        self.proc = subprocess.Popen(
            [str(binary()), "--events", self.events, "--listen", "127.0.0.1:0",
             "--block-size", str(self.block_size), "--tiers", self.tiers,
             # llm-d's own log lines, for a failure's post-mortem: 4 = DEBUG, 5 = TRACE
             "-v", os.environ.get("KVTIER_LLMD_INDEX_V", "4")],
            stdout=subprocess.PIPE, stderr=log, text=True)
        log.close()
        first = self.proc.stdout.readline().strip()  # "listening http://127.0.0.1:PORT"
        if not first.startswith("listening http://"):
            self.close()
            raise RuntimeError(f"llmd-index did not start: {first!r}; {self.log()[-2000:]}")
        self.url = first.split(" ", 1)[1]
        wait_for("llmd-index's query endpoint", lambda: self._get("/alive") == 200, 30, 0.1)
        return self

    def _get(self, path: str) -> int:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as resp:
                return resp.status
        except OSError:
            return 0

    def score(self, model: str, tokens: list[int], cache_salt: str = "") -> dict:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"llmd-index exited {self.proc.returncode}: {self.log()[-2000:]}")
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        status, raw = post_json(host, int(port), "/score",
                                {"model": model, "tokens": tokens, "cache_salt": cache_salt}, 10)
        if status != 200:
            raise RuntimeError(f"llmd-index /score answered {status}: {raw[:500]!r}")
        return json.loads(raw)

    def holders(self, model: str, tokens: list[int], cache_salt: str = "") -> list[set[tuple[str, str]]]:
        """For each whole block of `tokens` (salted with `cache_salt`, as llm-d keys
        vLLM's events), the (pod, tier) pairs llm-d's index holds."""
        return [{(h["pod"], h["tier"]) for h in block} for block in self.score(model, tokens, cache_salt)["blocks"]]

    def log(self) -> str:
        path = self.workdir / "llmd-index.log"
        return path.read_text() if path.exists() else ""

    def close(self) -> None:
        stop(self.proc, 5)
