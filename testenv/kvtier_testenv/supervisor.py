"""Process supervision for the node agent: each runnable container is a process in its
own session; readiness probes (httpGet, tcpSocket) against the pod IP; exits handled
per restartPolicy with a back-off; SIGTERM, then SIGKILL after the grace period; and
the pod status kubelet would report for all of it."""
from __future__ import annotations

import contextlib
import http.client
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.sidecar_config import pod_shm_name
from kvtier_testenv.podenv import PodSpecError, now_rfc3339

SHM_DIR = Path("/dev/shm")
"""The host's shared memory: every pod's /dev/shm here (a runtime gives each pod its own)."""

# kubelet probes every periodSeconds (default 10 s); tests cannot wait that long.
MAX_PROBE_PERIOD_S = 1.0
# kubelet's crash back-off starts at 10 s; one second keeps restart tests quick.
RESTART_BACKOFF_S = 1.0
# Cap on a pod's grace period: a draining sidecar needs its (default 30 s) grace, and
# the loop keeps serving other pods meanwhile, so only a stuck process waits this long.
MAX_GRACE_S = 60.0
# Grace for processes of pods that vanished, and for all of them when the agent stops
# (a test's teardown): short, so a stuck process cannot stall a test.
SHUTDOWN_GRACE_S = 5.0


@dataclass(slots=True)
class ContainerProcess:
    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    log: Path
    proc: subprocess.Popen | None = None
    started_at: str = ""
    restart_count: int = 0
    exit_code: int | None = None
    finished_at: str = ""
    ready: bool = False
    probe_failures: int = 0
    next_probe: float = 0.0
    restart_after: float = 0.0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass(slots=True)
class PodRun:
    """What the agent runs for one pod uid."""

    namespace: str
    name: str
    uid: str
    ip: str
    dir: Path
    containers: dict[str, ContainerProcess] = field(default_factory=dict)
    volume_versions: dict[str, str] = field(default_factory=dict)
    # (volume, source index) -> (token, monotonic time to renew it)
    tokens: dict[tuple[str, int], tuple[str, float]] = field(default_factory=dict)
    next_volume_sync: float = 0.0
    phase: str = "Pending"
    message: str = ""
    last_status: dict[str, Any] | None = None
    start_time: str = field(default_factory=now_rfc3339)
    kill_at: float | None = None  # monotonic SIGKILL time once SIGTERM was sent


def spawn(cp: ContainerProcess) -> None:
    with open(cp.log, "ab") as out:
        cp.proc = subprocess.Popen(cp.argv, env=cp.env, cwd=cp.cwd, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    cp.started_at, cp.exit_code, cp.ready, cp.probe_failures = now_rfc3339(), None, False, 0


def supervise(run: PodRun, pod: dict[str, Any]) -> None:
    """Probes live containers; handles exits per restartPolicy."""
    specs = {c["name"]: c for c in pod["spec"]["containers"]}
    policy = pod["spec"].get("restartPolicy", "Always")
    for cp in run.containers.values():
        if cp.alive():
            probe(run, cp, specs[cp.name])
            continue
        if cp.exit_code is None and cp.proc is not None:
            code = cp.proc.returncode
            # As a container runtime reports it: death by signal N is 128+N.
            cp.exit_code = code if code >= 0 else 128 - code
            cp.finished_at, cp.ready = now_rfc3339(), False
            cp.restart_after = time.monotonic() + RESTART_BACKOFF_S
        if policy == "Always" or (policy == "OnFailure" and cp.exit_code != 0):
            if time.monotonic() >= cp.restart_after:
                cp.restart_count += 1
                spawn(cp)
    if policy != "Always" and all(not cp.alive() for cp in run.containers.values()):
        codes = [cp.exit_code for cp in run.containers.values()]
        if policy == "Never" or all(code == 0 for code in codes):
            run.phase = "Succeeded" if all(code == 0 for code in codes) else "Failed"
            run.message = f"container exit codes {codes}"

def probe(run: PodRun, cp: ContainerProcess, spec: Mapping[str, Any]) -> None:
    probe = spec.get("readinessProbe")
    if not probe:
        cp.ready = True
        return
    now = time.monotonic()
    if now < cp.next_probe:
        return
    cp.next_probe = now + min(probe.get("periodSeconds", 10), MAX_PROBE_PERIOD_S)
    ok = probe_once(run, probe, spec)
    if ok:
        cp.ready, cp.probe_failures = True, 0
    else:
        cp.probe_failures += 1
        if not cp.ready or cp.probe_failures >= probe.get("failureThreshold", 3):
            cp.ready = False

def probe_port(port: int | str, spec: Mapping[str, Any]) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in spec.get("ports", []):
        if p.get("name") == port:
            return int(p["containerPort"])
    raise PodSpecError(f"probe names port {port!r}, which container {spec['name']!r} does not declare")

def probe_once(run: PodRun, probe: Mapping[str, Any], spec: Mapping[str, Any]) -> bool:
    timeout = min(probe.get("timeoutSeconds", 1), 1)
    if "httpGet" in probe:
        get = probe["httpGet"]
        host, port = get.get("host") or run.ip, probe_port(get["port"], spec)
        if get.get("scheme", "HTTP").upper() == "HTTPS":  # kubelet does not verify a probe's certificate
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                host, port, timeout=timeout, context=ssl._create_unverified_context())
        else:
            conn = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            conn.request("GET", get.get("path", "/"))
            return 200 <= conn.getresponse().status < 400
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()
    if "tcpSocket" in probe:
        port = probe_port(probe["tcpSocket"]["port"], spec)
        try:
            with socket.create_connection((run.ip, port), timeout=timeout):
                return True
        except OSError:
            return False
    return True  # exec/grpc probes: nothing to run them in; treat as passing

def pod_status(run: PodRun, pod: dict[str, Any]) -> dict[str, Any]:
    statuses = []
    for c in pod["spec"]["containers"]:
        cp = run.containers.get(c["name"])
        if cp is None:  # not runnable here: shown as running and ready
            statuses.append({"name": c["name"], "image": c.get("image", ""), "imageID": "",
                             "ready": True, "started": True, "restartCount": 0,
                             "state": {"running": {"startedAt": run.start_time}}})
            continue
        if cp.alive():
            state = {"running": {"startedAt": cp.started_at}}
        else:
            state = {"terminated": {"exitCode": cp.exit_code if cp.exit_code is not None else -1,
                                    "reason": "Completed" if cp.exit_code == 0 else "Error",
                                    "startedAt": cp.started_at, "finishedAt": cp.finished_at}}
        statuses.append({"name": c["name"], "image": c.get("image", ""), "imageID": "",
                         "ready": cp.ready and cp.alive(), "started": cp.alive(),
                         "restartCount": cp.restart_count, "state": state})
    containers_ready = run.phase == "Running" and all(s["ready"] for s in statuses)
    # Readiness gates, as kubelet honours them: the pod is Ready only when its containers
    # are and every gate's condition (set by its controller) is True.
    gates = [g.get("conditionType") for g in pod["spec"].get("readinessGates") or []]
    current = {c.get("type"): c for c in (pod.get("status") or {}).get("conditions") or []}
    gates_true = all((current.get(g) or {}).get("status") == "True" for g in gates)
    ready = containers_ready and gates_true
    ready_str = "True" if ready else "False"
    return {
        "phase": run.phase, "message": run.message, "podIP": run.ip, "podIPs": [{"ip": run.ip}],
        "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}], "startTime": run.start_time,
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Initialized", "status": "True"},
            {"type": "ContainersReady", "status": "True" if containers_ready else "False"},
            # (Status patches merge conditions by type: None clears a reason no longer true.)
            {"type": "Ready", "status": ready_str,
             "reason": "ReadinessGatesNotReady" if containers_ready and not ready else None,
             "message": "a readiness gate's condition is not True" if containers_ready and not ready else None},
        ],
        "containerStatuses": statuses,
    }


def begin_stop(run: PodRun, grace_s: float) -> None:
    """SIGTERM the pod's processes, once; SIGKILL is due at `run.kill_at`."""
    if run.kill_at is not None:
        return
    run.kill_at = time.monotonic() + min(max(float(grace_s), 0.0), MAX_GRACE_S)
    for cp in run.containers.values():
        if cp.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(cp.proc.pid, signal.SIGTERM)

def stop_run(run: PodRun, grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """Waits for the processes until `run.kill_at` (set here if no SIGTERM was sent
    yet), SIGKILLs what is left, removes the pod's directory."""
    begin_stop(run, grace_s)
    deadline = run.kill_at
    for cp in run.containers.values():
        if cp.proc is None:
            continue
        try:
            cp.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(cp.proc.pid, signal.SIGKILL)
            cp.proc.wait(timeout=10)
        # Children the container left in its session die with it, as in a pod.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(cp.proc.pid, signal.SIGKILL)
    shutil.rmtree(run.dir, ignore_errors=True)
    # A pod's /dev/shm goes with it; here the pods share the host's: remove what its
    # sidecar made there (the arena, its identity lock), whatever way it ended.
    name = pod_shm_name(run.namespace, run.name)
    for path in (SHM_DIR / name, SHM_DIR / f"{name}.lock"):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
