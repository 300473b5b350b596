"""Steady engine traffic to a workload's pods while a rollout moves them, for tests and
the demo: a background thread that, round after round, sends each ready pod lookups
under the weights version the pod serves (its kvtier.io/weights-version annotation),
through the real engine client (`kvtier_sidecar.client`). Per version, a mode says
what the traffic looks like:

- "hits":   a few prompts, stored on first sight (the engine "prefilled" them), so
            they hit from the next round on;
- "misses": a new prompt every lookup (a version whose prompts share no prefix);
- "off":    nothing.

Each lookup is reported to the sidecar as an engine does (`engine_io`): the prompt's
tokens and the hit's, all loaded. Every hit is read back and compared with the KV the version computes
(`synthetic.prefill_kv`, a pure function of the key root and tokens): `wrong_kv`
counts any difference, and must stay 0.
"""
from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import numpy as np

from kvtier.keys import KeyRoot
from kvtier.names import WEIGHTS_VERSION_ANNOTATION
from kvtier.sidecar_config import SidecarConfig
from kvtier_sidecar.client import EngineHit, SidecarClient
from kvtier_testenv import engine_io
from kvtier_testenv.kubectl import Kubectl
from kvtier_testenv.synthetic import prefill_kv

PROMPTS = 4
PROMPT_TOKENS = 72
# Lookups per pod per round: a few per second per pod keeps rates well above the
# alert rules' minimum without loading a 2-core machine.
LOOKUPS_PER_ROUND = 6
# Pause between rounds: pacing the generator, not waiting for anything.
ROUND_PAUSE_S = 0.3
VOCAB = 30_000


def tokens(i: int) -> np.ndarray:
    return np.random.default_rng(1000 + i).integers(0, VOCAB, PROMPT_TOKENS).astype(np.uint32)


def engine_socket(agent, namespace: str, pod: str) -> str:
    """The pod's sidecar engine socket (inside its kvtier-run volume on this host)."""
    env = agent.process(namespace, pod, "kvtier-sidecar").env
    return SidecarConfig(pod_name=pod, pod_namespace=namespace).engine_socket_path(env)


class Traffic:
    def __init__(self, kubectl: Kubectl, agent, selector: str, modes: dict[str, str],
                 root_of: Callable[[str], KeyRoot], block_size: int, block_bytes: int) -> None:
        self.kubectl, self.agent, self.selector = kubectl, agent, selector
        self.modes = dict(modes)
        self.root_of, self.block_size, self.block_bytes = root_of, block_size, block_bytes
        self.lookups: dict[str, int] = {}
        self.hits: dict[str, int] = {}
        self.wrong_kv = 0
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
        out = []
        for p in self.kubectl.get_json("pods", "-l", self.selector)["items"]:
            ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                        for c in (p.get("status") or {}).get("conditions") or [])
            version = (p["metadata"].get("annotations") or {}).get(WEIGHTS_VERSION_ANNOTATION)
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
        client = SidecarClient(engine_socket(self.agent, self.kubectl.namespace, pod))
        root = self.root_of(version)
        try:
            for n in range(LOOKUPS_PER_ROUND):
                self.serve(client, version, root, tokens(n % PROMPTS if mode == "hits" else next(self._fresh)),
                           offer=mode == "hits")
        finally:
            client.close()

    def serve(self, client: SidecarClient, version: str, root: KeyRoot, t: np.ndarray, offer: bool) -> None:
        """One request as a serving engine makes it: look up, read back and check a hit,
        report what was loaded and the prompt, release; on a miss the engine prefilled,
        and with `offer` it offers the prompt's KV for storing."""
        got = client.lookup(root, t)
        try:
            if isinstance(got, EngineHit):
                self._check(client, got, root, t)
            engine_io.report(client, len(t), got, len(got.blocks) if got else 0, self.block_bytes)
        finally:
            client.release(got)
        if offer and not got:
            client.store(root, t, prefill_kv(root, t, self.block_size, self.block_bytes))
        self.lookups[version] = self.lookups.get(version, 0) + 1

    def _check(self, client: SidecarClient, hit: EngineHit, root: KeyRoot, t: np.ndarray) -> None:
        dst = np.zeros(len(hit.blocks) * self.block_bytes, np.uint8)
        client.materialize(hit, dst)
        want = prefill_kv(root, t, self.block_size, self.block_bytes).reshape(-1)[: len(dst)]
        if not np.array_equal(dst, want):
            self.wrong_kv += 1
        self.hits[str(root.weights_version)] = self.hits.get(str(root.weights_version), 0) + 1
