"""Real vLLM engines for tests and benchmarks: `python -m kvtier_testenv.vllm_driver` run by the
cached vLLM venv's python (built by hack/vllm.sh), one process serving many generate
commands.

    eng = VllmEngine(workdir, model_dir, connector=connector_config(sock, "sha256:..")).start()
    out = eng.generate([[1, 2, 3, ...]], salts=["tenant-a"], max_tokens=8)
    out["outputs"][0], out["cached"][0]
    eng.close()
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DRIVER_MODULE = "kvtier_testenv.vllm_driver"
START_TIMEOUT_S = 600.0
"""Engine start-up on two busy cores: imports, model load, KV allocation, warm-up."""
GENERATE_TIMEOUT_S = 300.0
KV_CACHE_SPACE_GIB = "1"
"""VLLM_CPU_KVCACHE_SPACE: the tiny model needs little; keeps several engines in RAM."""
VLLM_BLOCK_SIZE = 32
"""vLLM's CPU attention backend wants a multiple of 32 tokens per block."""


def vllm_python() -> str:
    """The vLLM venv's python; fails loudly when hack/vllm.sh has not built it."""
    out = subprocess.run(["bash", str(REPO / "hack" / "vllm.sh"), "--print-python"], check=True,
                         capture_output=True, text=True).stdout.strip()
    if not os.access(out, os.X_OK) or not (Path(out).parent.parent / ".complete").exists():
        raise RuntimeError(f"the vLLM venv is not built ({out}); run hack/vllm.sh (scripts/setup.sh does)")
    return out


def checkout_pythonpath() -> str:
    """This checkout's kvtier, sidecar client and kvtier_vllm, for the vLLM venv's python.

    The cached venv is shared by every checkout on the machine (it never installs kvtier),
    so each launch names its own checkout rather than the venv remembering one."""
    return os.pathsep.join(str(REPO / d) if d else str(REPO) for d in ("", "sidecar", "connector"))


def vllm_cache_seed() -> Path:
    """hack/vllm.sh's VLLM_CACHE_ROOT seed: vLLM's model-info cache for the tiny Llama
    architecture, so an engine start skips inspecting the model class in a subprocess of
    its own (a third torch import, ~20 s on two cores). vLLM checks each entry's hash of
    its model file: a stale seed costs that subprocess, never a wrong answer."""
    seed = Path(vllm_python()).parent.parent / "cache-seed"
    if not (seed / "modelinfos").is_dir():
        raise RuntimeError(f"no vLLM cache seed at {seed}; run hack/vllm.sh (scripts/setup.sh does)")
    return seed


def seed_vllm_cache(root: Path) -> Path:
    """Makes `root` a VLLM_CACHE_ROOT holding the seed's model-info cache; returns it."""
    dest = Path(root) / "modelinfos"
    dest.mkdir(parents=True, exist_ok=True)
    for entry in (vllm_cache_seed() / "modelinfos").iterdir():
        if not (dest / entry.name).exists():
            shutil.copyfile(entry, dest / entry.name)
    return Path(root)


@functools.cache
def rpc_base_path() -> str:
    """One directory per test process for vLLM's ZeroMQ IPC sockets, removed when the
    process exits. vLLM makes `<VLLM_RPC_BASE_PATH>/<uuid4>` sockets (default: /tmp) and
    leaves them behind whenever an engine is stopped by a signal."""
    path = tempfile.mkdtemp(prefix="kvtier-vllm-rpc-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def vllm_env(base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment for a process run by the vLLM venv's python: `base` (default: this
    process's), its PYTHONPATH replaced by this checkout's packages, plus `extra`. A
    VLLM_CACHE_ROOT in `extra` is seeded (`seed_vllm_cache`); vLLM's IPC sockets go to
    `rpc_base_path()` unless `extra` names another place."""
    env = {"VLLM_RPC_BASE_PATH": rpc_base_path(), **(os.environ if base is None else base), **extra}
    env["PYTHONPATH"] = checkout_pythonpath()
    if "VLLM_CACHE_ROOT" in extra:
        seed_vllm_cache(Path(extra["VLLM_CACHE_ROOT"]))
    return env


def connector_config(socket: str, weights_version: str, **extra) -> dict:
    """A --kv-transfer-config for KvtierConnector on the sidecar at `socket`."""
    return {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier_vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"socket": socket, "weights_version": weights_version, **extra}}


def sidecar_model(shape, weights_version: str = "unused") -> dict:
    """The sidecar's `model` section for a tiny_llama shape (float32 KV)."""
    return {"model_id": "tiny-llama", "weights_version": weights_version, "kv_dtype": "float32",
            "layers": shape.layers, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim, "dtype_bytes": 4}


@dataclass
class VllmEngine:
    workdir: Path
    model: Path
    connector: dict | None = None
    name: str = "vllm"
    enable_prefix_caching: bool = False
    proc: subprocess.Popen | None = None
    _stderr_tail: list[str] = field(default_factory=list)

    def start(self) -> "VllmEngine":
        spec = {"model": str(self.model), "kv_transfer_config": self.connector, "block_size": VLLM_BLOCK_SIZE,
                "enable_prefix_caching": self.enable_prefix_caching}
        env = vllm_env(VLLM_CPU_KVCACHE_SPACE=KV_CACHE_SPACE_GIB,
                       VLLM_CACHE_ROOT=str(self.workdir / f"{self.name}-cache"),
                       VLLM_CONFIGURE_LOGGING="1", PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] += os.pathsep + str(REPO / "testenv")  # the driver, beside what an engine has
        self.proc = subprocess.Popen([vllm_python(), "-m", DRIVER_MODULE, json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     cwd=self.workdir, start_new_session=True)
        self._log = open(self.workdir / f"{self.name}.log", "a")
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        self._read("READY", START_TIMEOUT_S)
        return self

    def _drain_stderr(self) -> None:
        for line in self.proc.stderr:
            self._log.write(line)
            self._log.flush()
            self._stderr_tail.append(line)
            del self._stderr_tail[:-200]

    def _read(self, tag: str, timeout_s: float) -> dict:
        box: dict = {}

        def reader() -> None:
            for line in self.proc.stdout:
                if line.startswith(tag + " "):
                    box["value"] = json.loads(line[len(tag) + 1 :])
                    return

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        t.join(timeout_s)
        if "value" not in box:
            raise RuntimeError(f"vLLM engine {self.name}: no {tag} within {timeout_s}s (exit {self.proc.poll()}):\n"
                               + "".join(self._stderr_tail[-40:]))
        return box["value"]

    def generate(self, prompts: list[list[int]], salts: list[str | None] | None = None,
                 max_tokens: int = 8) -> dict:
        cmd = {"op": "generate", "prompts": prompts, "salts": salts, "max_tokens": max_tokens}
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read("RESULT", GENERATE_TIMEOUT_S)

    def log_text(self) -> str:
        return (self.workdir / f"{self.name}.log").read_text(errors="replace")

    def close(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(60)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
