"""The replay engine stops on an event (a stop file), not only at a deadline: chaos
tests end the engines once the fault they stage has been observed."""
import threading
import time

from kvtier_testenv.workload import make_workload, replay

from .test_sidecar_process import poll

# Far beyond any run: reaching it would mean the stop file was ignored.
CAP_S = 300.0


def test_replay_returns_once_its_stop_file_appears_before_the_deadline(spawn, tmp_path):
    sc = spawn()
    stop = tmp_path / "stop"
    work = make_workload(tenants=2, templates=2, requests=40, seed=3)

    def stop_after_traffic():
        try:
            poll(lambda: sc.stats()["lookups"] >= 10, timeout_s=60)
        finally:
            stop.touch()
    t = threading.Thread(target=stop_after_traffic)
    t.start()
    deadline = time.monotonic() + CAP_S
    stats = replay(sc.socket, work, "synthetic", deadline_s=deadline, stop_file=str(stop))
    t.join()
    assert time.monotonic() < deadline
    assert stats.requests >= 10 and stats.errors == 0 and stats.wrong_kv == 0


def test_replay_with_its_stop_file_already_present_sends_nothing(spawn, tmp_path):
    sc = spawn()
    stop = tmp_path / "stop"
    stop.touch()
    stats = replay(sc.socket, make_workload(tenants=1, templates=1, requests=5, seed=3), "synthetic",
                   deadline_s=time.monotonic() + CAP_S, stop_file=str(stop))
    assert stats.requests == 0 and sc.stats()["lookups"] == 0
