"""A step's loads copied layer by layer on a thread while the forward pass runs.

vLLM calls `wait_for_layer_load(layer)` right before each attention layer reads its
KV; the copy of layer l+1 then overlaps the compute of layer l. A layer's event is
set only after every job's copy of that layer ended (copied, or failed and recorded),
so a layer never runs on half-copied KV without the job being reported. A job whose
copy raises copies nothing more and all its blocks are reported as load errors, which
vLLM (`kv_load_failure_policy: recompute`) recomputes.

The connector uses this only after a forward pass in which every layer asked for its
load: an engine that never calls `wait_for_layer_load` keeps the synchronous copy.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

log = logging.getLogger("vllm.kvtier_vllm")  # see connector.py

CopyLayer = Callable[[int], None]
"""Copies one layer of one job (raises on failure)."""


@dataclass
class LayerJob:
    """One request's load: `copy(layer)` moves that layer of its `blocks` blocks."""

    copy: CopyLayer
    blocks: int
    failed: bool = field(default=False)


class LayerLoads:
    def __init__(self, jobs: Sequence[LayerJob], num_layers: int) -> None:
        self.jobs = list(jobs)
        self.ready = [threading.Event() for _ in range(num_layers)]
        self._thread = threading.Thread(target=self._run, name="kvtier-layer-loads", daemon=True)

    def start(self) -> "LayerLoads":
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            for layer, ready in enumerate(self.ready):
                for job in self.jobs:
                    if job.failed:
                        continue
                    try:
                        job.copy(layer)
                    except Exception:
                        job.failed = True
                        log.exception("kvtier layer %d load failed; vLLM recomputes the request's blocks", layer)
                ready.set()
        finally:
            for ready in self.ready:  # never leave a waiting layer hanging
                ready.set()

    def wait(self, layer: int) -> None:
        self.ready[layer].wait()

    def finish(self) -> list[LayerJob]:
        """Wait for every copy; the jobs that failed."""
        self._thread.join()
        return [job for job in self.jobs if job.failed]
