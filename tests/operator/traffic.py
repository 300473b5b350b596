"""Steady engine traffic to a StatefulSet's pods while a rollout moves them: a background
thread that, round after round, sends each ready pod lookups under the weights version
the pod serves (its kvtier.io/weights-version annotation), through the real engine
client. Per version, the mode says what the traffic looks like:

- "hits":   a small set of prompts, stored on first sight: after two rounds they hit;
- "misses": a new prompt every lookup (a version whose cache never helps);
- "off":    nothing (the pods stay quiet).
"""
from __future__ import annotations

import itertools
import threading

import numpy as np

from kvtier.keys import KeyRoot
from kvtier_operator import names
from kvtier_sidecar.client import SidecarClient
from kvtier_testenv.synthetic import prefill_kv
from kvtier_testenv.kubectl import Kubectl
from sidecar_fleet import BLOCK_BYTES, BLOCK_SIZE, PROMPT_TOKENS, PodSidecar

PROMPTS = 4
# Lookups per pod per round: a few per second per pod keeps rates well above the
# rules' minimum without loading the 2-core CI box.
LOOKUPS_PER_ROUND = 6
# Pause between rounds: pacing the generator, not waiting for anything.
ROUND_PAUSE_S = 0.3


def root(version: str, tenant: str = "acme") -> KeyRoot:
    return KeyRoot(tenant, "reference-tiny", version, "fp16", "rope-default", "default")


def tokens(i: int) -> np.ndarray:
    return np.random.default_rng(1000 + i).integers(0, 30_000, PROMPT_TOKENS).astype(np.uint32)


class Traffic:
    def __init__(self, kubectl: Kubectl, agent, app: str, modes: dict[str, str]) -> None:
        self.kubectl, self.agent, self.app = kubectl, agent, app
        self.modes = dict(modes)
        self.lookups: dict[str, int] = {}
        self.errors = 0
        self._fresh = itertools.count(10_000)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="traffic", daemon=True)

    def start(self) -> "Traffic":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def set(self, version: str, mode: str) -> None:
        self.modes[version] = mode

    def _pods(self) -> list[tuple[str, str]]:
        items = self.kubectl.get_json("pods", "-l", f"app={self.app}")["items"]
        out = []
        for p in items:
            ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                        for c in (p.get("status") or {}).get("conditions") or [])
            version = (p["metadata"].get("annotations") or {}).get(names.WEIGHTS_VERSION_ANNOTATION)
            if ready and version and not p["metadata"].get("deletionTimestamp"):
                out.append((p["metadata"]["name"], version))
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for pod, version in self._pods():
                    mode = self.modes.get(version, "off")
                    if mode != "off":
                        self._round(pod, version, mode)
            except Exception:  # a pod restarting under the rollout: try again next round
                self.errors += 1
            self._stop.wait(ROUND_PAUSE_S)

    def _round(self, pod: str, version: str, mode: str) -> None:
        sc = PodSidecar.of(self.agent, self.kubectl.namespace, pod)
        client = SidecarClient(sc.socket)
        try:
            for n in range(LOOKUPS_PER_ROUND):
                i = n % PROMPTS if mode == "hits" else next(self._fresh)
                t = tokens(i)
                got = client.lookup(root(version), t)
                client.release(got)
                if mode == "hits" and not got:  # a miss: the engine prefilled; offer it
                    client.store(root(version), t, prefill_kv(root(version), t, BLOCK_SIZE, BLOCK_BYTES))
                self.lookups[version] = self.lookups.get(version, 0) + 1
        finally:
            client.close()
