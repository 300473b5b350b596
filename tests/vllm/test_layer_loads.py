"""Layer-by-layer loads: a layer is released only after every job's copy of it ended,
and a job whose copy fails stops copying and is reported, without holding any layer."""
from __future__ import annotations

import threading

from kvtier_vllm.layer_loads import LayerJob, LayerLoads


def test_each_layer_is_released_only_after_every_jobs_copy_of_it():
    copied: list[tuple[str, int]] = []
    gate = threading.Event()

    def copier(name: str):
        def copy(layer: int) -> None:
            if layer == 1:
                gate.wait(10)
            copied.append((name, layer))
        return copy

    loads = LayerLoads([LayerJob(copier("a"), 3), LayerJob(copier("b"), 2)], num_layers=3).start()
    loads.wait(0)
    assert {("a", 0), ("b", 0)} <= set(copied)
    assert not loads.ready[1].is_set()  # layer 1 of job a is still copying
    gate.set()
    loads.wait(2)
    assert sorted(copied) == sorted((n, l) for n in "ab" for l in range(3))
    assert loads.finish() == []


def test_a_failing_job_stops_copying_is_reported_and_never_blocks_a_layer():
    seen: list[int] = []

    def broken(layer: int) -> None:
        if layer == 1:
            raise OSError("arena gone")
        seen.append(layer)

    good: list[int] = []
    bad_job, good_job = LayerJob(broken, 4), LayerJob(good.append, 4)
    loads = LayerLoads([bad_job, good_job], num_layers=4).start()
    for layer in range(4):
        loads.wait(layer)
    assert loads.finish() == [bad_job]
    assert seen == [0] and good == [0, 1, 2, 3]
