"""kvtier's real Endpoint Picker (router/epp's `kvtier-epp`, built by `hack/epp.sh`)
against a real kube-apiserver, driven over its real ext_proc gRPC protocol by
router/epp's `extproc-gateway` (a stand-in for Envoy, which cannot be had here).

    bins = epp.find()                                 # both binaries, or EppBinariesMissing
    epp.install_pool_crds(admin)                      # the module's CRDs (InferencePool)
    epp.apply_pool(k, "kvtier", {"app": "vllm"})      # the pool the EPP serves
    epp.serving_pod(k, "vllm-a", "127.0.0.11", {"app": "vllm"})  # Ready, no kubelet
    with epp.Picker(bins, cp.kubeconfig, ns, "kvtier", config, log) as picker:
        picker.wait_routes(...)                       # the EPP up and its pods known
        picker.ask("x-tenant-id=acme")                # {"endpoint": "ip:port", "body": {...}}

The model-server pods are Pod objects whose status is set here (phase Running, an IP,
Ready): no kubelet, no vLLM. The EPP's default metrics source scrapes
http://<pod IP>:<targetPort>/metrics every 50 ms: where nothing listens the scrape fails
(logged) and the endpoint has no occupancy report, which kvtier's pick treats as empty,
so a tenant lands on its first home; an `EngineMetrics` there serves vLLM's gauges with
the KV occupancy a test sets (a hot home makes the scorer spill). Shared by `tests/router` and
`hack/epp-smoke.py`. Missing binaries raise `EppBinariesMissing` with the fix (run
scripts/setup.sh): a test that needs them fails, it never skips.
"""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from kvtier import control_api, names
from kvtier_testenv.kubectl import Kubectl
from kvtier_testenv.polling import wait_for
from kvtier_testenv.ports import free_port

EPP_DIR_ENV = "KVTIER_EPP_DIR"
REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "hack" / "epp.sh"
MODULE_DIR = REPO_ROOT / "router" / "epp"
SHIPPED_CONFIG = MODULE_DIR / "config" / "kvtier-epp.yaml"
GIE_MODULE = "sigs.k8s.io/gateway-api-inference-extension"
# The EPP derives its own name from its pod's (a Deployment pod's: <deployment>-<hash>-<suffix>),
# given, as the chart does, in POD_NAME (and its namespace in NAMESPACE).
POD_NAME = "kvtier-epp-5d8f7c9b6-x2x4q"
TARGET_PORT = 8000
CHAT_BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
# Its informers list the pool and its pods, and its gRPC server starts: seconds on a quiet
# machine, much more on the shared 2-core one.
START_TIMEOUT_S = 90.0


class EppBinariesMissing(RuntimeError):
    """kvtier-epp or extproc-gateway has not been built (or the cache was removed)."""


@dataclass(frozen=True, slots=True)
class EppBinaries:
    epp: Path
    gateway: Path


def find() -> EppBinaries:
    """Both binaries: in $KVTIER_EPP_DIR, else where `hack/epp.sh` caches them for the
    current sources; EppBinariesMissing naming the fix when either is absent."""
    explicit = os.environ.get(EPP_DIR_ENV)
    directory = Path(explicit) if explicit else _script_dir()
    bins = EppBinaries(directory / "kvtier-epp", directory / "extproc-gateway")
    missing = [str(p) for p in (bins.epp, bins.gateway) if not os.access(p, os.X_OK)]
    if missing:
        raise EppBinariesMissing(
            f"{', '.join(missing)} not built for the current router/epp sources: run "
            f"scripts/setup.sh (or `GOFLAGS=-p=1 nice -n 5 hack/epp.sh`), or point {EPP_DIR_ENV} "
            f"at a directory holding kvtier-epp and extproc-gateway")
    return bins


@functools.cache
def _script_dir() -> Path:
    out = subprocess.run(["bash", str(BUILD_SCRIPT), "--print-dir"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise EppBinariesMissing(f"{BUILD_SCRIPT} --print-dir failed ({out.returncode}): {out.stderr.strip()}")
    return Path(out.stdout.strip())


@functools.cache
def gie_module_dir() -> Path:
    """The EPP module's source in Go's module cache (scripts/setup.sh downloads it)."""
    env = {**os.environ, "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=readonly"}
    out = subprocess.run(["go", "list", "-m", "-f", "{{.Dir}}", GIE_MODULE], cwd=MODULE_DIR,
                         capture_output=True, text=True, timeout=120, env=env)
    directory = Path(out.stdout.strip())
    if out.returncode != 0 or not (directory / "config/crd/bases").is_dir():
        raise EppBinariesMissing(f"{GIE_MODULE}'s source is not in Go's module cache ({out.stderr.strip()}): "
                                 "run scripts/setup.sh")
    return directory


def install_pool_crds(admin: Kubectl) -> list[str]:
    """The EPP module's CRDs (InferencePool, ...) that the API server lacks, served
    before this returns; the names of those it created (for `remove_crds`, which leaves a
    shared API server as it was). v1.5.0's standalone mode (--endpoint-selector, no pool)
    cannot start (its flag check forbids --pool-name with it and its datastore refuses the
    empty pool name), so the EPP runs as in a cluster, on an InferencePool."""
    created = []
    for crd in sorted((gie_module_dir() / "config/crd/bases").glob("*.yaml")):
        name = yaml.safe_load(crd.read_text())["metadata"]["name"]
        # one an earlier test removed (remove_crds does not wait) may still be going
        wait_for(f"CRD {name} to finish its deletion", lambda: admin.run(
            "get", "crd", name, "-o", "jsonpath={.metadata.deletionTimestamp}", check=False).stdout.strip() == "",
            timeout_s=60)
        if admin.run("get", "crd", name, check=False).returncode != 0:
            admin.run("apply", "--server-side", "-f", str(crd))
            created.append(name)
    wait_for("the InferencePool CRD to be served",
             lambda: admin.run("get", "inferencepools.inference.networking.k8s.io", "-A", check=False).returncode == 0,
             timeout_s=30)
    return created


def remove_crds(admin: Kubectl, crds: list[str]) -> None:
    for name in crds:
        admin.run("delete", "crd", name, "--wait=false", check=False)


def apply_pool(kubectl: Kubectl, name: str, selector: dict[str, str], target_port: int = TARGET_PORT) -> None:
    """An InferencePool in kubectl's namespace selecting the serving pods."""
    pool = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": name},
            "spec": {"selector": {"matchLabels": selector}, "targetPorts": [{"number": target_port}],
                     "endpointPickerRef": {"name": "kvtier-epp", "port": {"number": 9002}}}}
    kubectl.run("apply", "-f", "-", input=json.dumps(pool))


def serving_pod(kubectl: Kubectl, name: str, ip: str, labels: dict[str, str], target_port: int = TARGET_PORT) -> None:
    """A Pod object that looks Running and Ready at `ip` (its status set directly: no kubelet)."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
           "spec": {"containers": [{"name": "vllm", "image": "vllm", "ports": [{"containerPort": target_port}]}]}}
    kubectl.run("apply", "-f", "-", input=json.dumps(pod))
    status = {"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                         "conditions": [{"type": "Ready", "status": "True"}]}}
    kubectl.run("patch", "pod", name, "--subresource=status", "--type=merge", "-p", json.dumps(status))


class EngineMetrics:
    """vLLM's /metrics as the EPP scrapes it (vllm:kv_cache_usage_perc, and the queue
    gauges), served on `ip:port` (a pod's IP and the pool's targetPort), with the KV
    occupancy in [0, 1] that `kv_usage` holds and the queue lengths `waiting` and
    `running` hold."""

    def __init__(self, ip: str, port: int, kv_usage: float = 0.0) -> None:
        self.kv_usage = kv_usage
        self.waiting = self.running = 0  # vLLM's queue gauges (the EPP's queue scorer reads waiting)
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                # /metrics: vLLM's path, the EPP's --model-server-metrics-path default, and
                # the sidecar's (the suite spells it once)
                if self.path.split("?")[0] != control_api.METRICS.path:
                    self.send_error(404)
                    return
                # typed: the EPP reads a gauge's value (an untyped sample reads as 0)
                gauges = (("num_requests_waiting", 'model_name="m"', stub.waiting),
                          ("num_requests_running", 'model_name="m"', stub.running),
                          ("kv_cache_usage_perc", 'model_name="m"', stub.kv_usage),
                          ("lora_requests_info", 'max_lora="0",running_lora_adapters="",waiting_lora_adapters=""', 1),
                          ("cache_config_info", 'block_size="16",num_gpu_blocks="1024"', 1))
                body = "".join(f"# TYPE vllm:{name} gauge\nvllm:{name}{{{labels}}} {value}\n"
                               for name, labels, value in gauges).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer((ip, port), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, name=f"engine-metrics-{ip}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def picker_config(table_path: Path | str, **table_parameters: str) -> str:
    """The shipped EndpointPickerConfig (router/epp/config/kvtier-epp.yaml) with the
    table file at `table_path` and `table_parameters` (redisUrl, redisKey,
    redisPasswordFile, redisInterval, checkInterval, ...) added to both the screener's
    and the scorer's parameters (they read one table source)."""
    config = yaml.safe_load(SHIPPED_CONFIG.read_text())
    for plugin in config["plugins"]:
        if plugin["type"] in ("kvtier-version-screener", "kvtier-affinity-scorer"):
            plugin["parameters"] = {**plugin["parameters"], "tablePath": str(table_path), **table_parameters}
    return yaml.safe_dump(config, sort_keys=False)


class Picker:
    """One kvtier-epp process serving the InferencePool `pool` of `namespace`, with TLS
    on its ext_proc port (the runner's default: a self-signed certificate, which
    extproc-gateway does not verify, as gateways configured for an EPP do not)."""

    def __init__(self, bins: EppBinaries, kubeconfig: Path | str, namespace: str, pool: str,
                 config: Path | str, log_path: Path | str, target_port: int = TARGET_PORT,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.bins = bins
        self.extra_args = extra_args  # more runner flags
        self.target_port = target_port  # the pool's: endpoints are <pod IP>:<target_port>
        self.kubeconfig = Path(kubeconfig)
        self.namespace = namespace
        self.pool = pool
        self.config = Path(config)
        self.log_path = Path(log_path)
        self.grpc_port = self.health_port = self.metrics_port = 0
        self.proc: subprocess.Popen | None = None
        self.last_error = ""  # the last failed exchange's stderr

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self) -> "Picker":
        self.grpc_port, self.health_port, self.metrics_port = free_port(), free_port(), free_port()
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), names.POD_NAME_ENV: POD_NAME,
               "NAMESPACE": self.namespace}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [str(self.bins.epp), "--config-file", str(self.config),
                 "--pool-namespace", self.namespace, "--pool-name", self.pool,
                 "--grpc-port", str(self.grpc_port), "--grpc-health-port", str(self.health_port),
                 "--metrics-port", str(self.metrics_port), "--enable-pprof=false", "--tracing=false",
                 *self.extra_args],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def ask(self, *headers: str | bytes, body: str = CHAT_BODY, timeout_s: float = 5.0) -> dict[str, Any] | None:
        """One request's exchange: the gateway's JSON ({"endpoint", "body" | "rawBody",
        "immediateStatus", "immediateBody"}), None when the exchange failed (the EPP
        not serving yet). `headers` are name=value (bytes for values that are not UTF-8)."""
        self.check_alive()
        cmd: list[str | bytes] = [str(self.bins.gateway), "-addr", self.address, "-body", body,
                                  "-timeout", f"{timeout_s}s"]
        for h in headers:
            cmd += ["-H", h]
        out = subprocess.run(cmd, capture_output=True, timeout=timeout_s + 10)
        self.check_alive()
        if out.returncode != 0:
            self.last_error = out.stderr.decode(errors="replace").strip()
            return None
        return json.loads(out.stdout)

    def endpoint(self, ip: str) -> str:
        return f"{ip}:{self.target_port}"

    def wait_lands(self, what: str, ip: str, *headers: str | bytes, timeout_s: float = 30.0) -> dict[str, Any]:
        """Until a request with `headers` is routed to `ip`; the last exchange's result."""
        want = self.endpoint(ip)

        def probe():
            r = self.ask(*headers)
            return r if r and r.get("endpoint") == want else None
        return wait_for(what, probe, timeout_s=timeout_s, interval_s=0.05)

    def check_alive(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            code = None if self.proc is None else self.proc.returncode
            raise RuntimeError(f"kvtier-epp is not running (exit {code}); its log's tail:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "Picker":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
