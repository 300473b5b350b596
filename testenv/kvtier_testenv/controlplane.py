"""A real Kubernetes control plane on loopback: etcd, kube-apiserver and (optionally)
kube-controller-manager, started the way controller-runtime's envtest starts them.

    with ControlPlane(controller_manager=True) as cp:
        subprocess.run([kubectl, "--kubeconfig", cp.kubeconfig, "get", "ns"])

What it sets up, in a private temp directory:

- a CA (openssl, EC P-256) that signs the API server's serving certificate (for
  127.0.0.1 and localhost) and every client certificate; the API server trusts it
  for client-certificate authentication (`--client-ca-file`);
- an admin client certificate (CN=kvtier-admin, O=system:masters) and a kubeconfig
  for it (`cp.kubeconfig`); `kubeconfig_for_user` issues more users,
  `kubeconfig_for_service_account` a ServiceAccount token (TokenRequest API), so an
  operator can run with exactly the RBAC its chart grants;
- a service-account signing key and issuer, RBAC authorization, and envtest's other
  flags (the ServiceAccount admission plugin off, so pods need no token volume);
- kube-controller-manager with the workload controllers (StatefulSet, Deployment,
  ReplicaSet, Job, DaemonSet), garbage collector, namespace, service-account and
  token, endpoints and root-CA publisher. Node lifecycle is off: the fake node of
  the node agent has no kubelet heartbeat and must not have its pods evicted.

Readiness is polled with a deadline (etcd /health, apiserver /readyz, and for the
controller-manager the `default` ServiceAccount its controller creates). Process
output goes to `log_dir`; a failed start raises with the tail of the logs. `stop()`
terminates all three, waits, and confirms their ports are free again.
"""
from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvtier_testenv import binaries
from kvtier_testenv.ports import free_port

HOST = "127.0.0.1"
# A cold apiserver start on a loaded 2-core machine takes ~5-15 s; beyond this, fail.
APISERVER_READY_TIMEOUT_S = 90.0
ETCD_READY_TIMEOUT_S = 30.0
CONTROLLER_MANAGER_READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
POLL_INTERVAL_S = 0.1
# Lines of each log shown in an error, enough to see the cause of a failed start.
LOG_TAIL_LINES = 40
SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
ADMIN_USER = "kvtier-admin"
# Controllers a test or the demo relies on; everything cloud/node-lifecycle related
# stays off (there is no kubelet, no cloud, no volumes).
CONTROLLERS = (
    "deployment-controller",
    "replicaset-controller",
    "statefulset-controller",
    "daemonset-controller",
    "job-controller",
    "cronjob-controller",
    "replicationcontroller-controller",
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "endpoints-controller",
    "endpointslice-controller",
    "endpointslice-mirroring-controller",
    "disruption-controller",
    "root-ca-certificate-publisher-controller",
    "pod-garbage-collector-controller",
    "resourcequota-controller",
    "ttl-after-finished-controller",
)
_PR_SET_PDEATHSIG = 1


class ControlPlaneError(RuntimeError):
    """A control-plane component failed to start or stop; carries its log tail."""


def port_is_free(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _die_with_parent() -> None:
    """Child-side: SIGKILL this process if the Python that started it dies (no leaks
    even when pytest itself is killed). Linux ties this to the starting *thread*:
    start a ControlPlane from a thread that outlives it (the main thread)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:])


# --- certificates (openssl) ----------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    out = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if out.returncode != 0:
        raise ControlPlaneError(f"openssl {' '.join(args)} failed: {out.stderr.strip()}")


@dataclass(slots=True)
class CertificateAuthority:
    """A throwaway CA in `directory`: ca.crt/ca.key, and leaf certs it signs."""

    directory: Path
    cert: Path = field(init=False)
    key: Path = field(init=False)

    def __post_init__(self) -> None:
        self.cert = self.directory / "ca.crt"
        self.key = self.directory / "ca.key"
        _openssl(
            "req", "-x509", "-new", "-nodes", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-keyout", self.key.name, "-out", self.cert.name, "-days", "365",
            "-subj", "/CN=kvtier-testenv-ca", cwd=self.directory,
        )

    def issue(self, name: str, subject: str, *, server: bool = False,
              ips: tuple[str, ...] = ("10.0.0.1",)) -> tuple[Path, Path]:
        """Signs a new key pair; `server=True` adds loopback SANs, the Service names of
        the API server, `ips`, and serverAuth."""
        key, csr, crt, ext = (self.directory / f"{name}.{s}" for s in ("key", "csr", "crt", "ext"))
        if server:
            ext.write_text(
                "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
                "DNS:kubernetes.default.svc" + "".join(f",IP:{ip}" for ip in ips if ip != "127.0.0.1") + "\n"
                "extendedKeyUsage=serverAuth\nkeyUsage=digitalSignature,keyEncipherment\n"
            )
        else:
            ext.write_text("extendedKeyUsage=clientAuth\nkeyUsage=digitalSignature,keyEncipherment\n")
        _openssl(
            "req", "-new", "-nodes", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-keyout", key.name, "-out", csr.name, "-subj", subject, cwd=self.directory,
        )
        _openssl(
            "x509", "-req", "-in", csr.name, "-CA", self.cert.name, "-CAkey", self.key.name,
            "-CAcreateserial", "-out", crt.name, "-days", "365", "-extfile", ext.name,
            cwd=self.directory,
        )
        return crt, key


def _subject(user: str, groups: tuple[str, ...]) -> str:
    for part in (user, *groups):
        if not part or any(c in part for c in "/=,+"):
            raise ValueError(f"user/group name {part!r} must be non-empty without / = , +")
    return f"/CN={user}" + "".join(f"/O={g}" for g in groups)


def write_kubeconfig(path: Path, server: str, ca: Path, *, cert: Path | None = None,
                     key: Path | None = None, token: str | None = None,
                     user: str = ADMIN_USER, namespace: str = "default") -> Path:
    """A one-context kubeconfig (JSON is valid YAML) for `user` against `server`."""
    creds: dict[str, str] = {}
    if cert is not None and key is not None:
        creds = {"client-certificate": str(cert), "client-key": str(key)}
    elif token is not None:
        creds = {"token": token}
    else:
        raise ValueError("a kubeconfig needs a client certificate+key or a token")
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kvtier", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": creds}],
        "contexts": [{"name": "kvtier", "context": {"cluster": "kvtier", "user": user, "namespace": namespace}}],
        "current-context": "kvtier",
    }
    path.write_text(json.dumps(doc, indent=2))
    path.chmod(0o600)
    return path


# --- the control plane ---------------------------------------------------------------


@dataclass(slots=True)
class _Component:
    name: str
    proc: subprocess.Popen
    log: Path
    ports: tuple[int, ...]
    host: str = HOST


class ControlPlane:
    """etcd + kube-apiserver (+ kube-controller-manager) on free loopback ports.

    Invariant: after `stop()` (or leaving the `with` block) none of its processes is
    alive and none of its ports is bound; `start()` cleans up what it started when
    any component fails to come up.
    """

    def __init__(self, *, controller_manager: bool = True, log_dir: Path | None = None,
                 keep_dir: bool = False, host: str = HOST,
                 service_cidr: str = SERVICE_CLUSTER_IP_RANGE, real_nodes: bool = False) -> None:
        """`real_nodes=True` is for a cluster with kubelets (`kvtier_testenv.nodes`): the
        API server listens on `host` (an address pods reach), publishes it as the
        `kubernetes` Service's endpoint, runs the ServiceAccount admission plugin and the
        Node authorizer with NodeRestriction, and can call kubelets with its own client
        certificate."""
        self.bins = binaries.find()
        self.controller_manager = controller_manager
        self.host = host
        self.service_cidr = service_cidr
        self.real_nodes = real_nodes
        self.dir = Path(tempfile.mkdtemp(prefix="kvtier-controlplane-"))
        self.log_dir = Path(log_dir) if log_dir else self.dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.keep_dir = keep_dir
        self.pki = self.dir / "pki"
        self.pki.mkdir()
        self._components: list[_Component] = []
        self.apiserver_port = 0
        self.kubeconfig = self.dir / "admin.kubeconfig"
        self.ca: CertificateAuthority | None = None
        self.etcd_data: Path | None = None

    # -- public API --

    @property
    def url(self) -> str:
        return f"https://{self.host}:{self.apiserver_port}"

    @property
    def ca_cert(self) -> Path:
        assert self.ca is not None, "control plane not started"
        return self.ca.cert

    def start(self) -> "ControlPlane":
        try:
            self._make_pki()
            self._start_etcd()
            self._start_apiserver()
            if self.controller_manager:
                self._start_controller_manager()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Terminates every component (newest first), then checks ports are free."""
        errors: list[str] = []
        for comp in reversed(self._components):
            _terminate(comp.proc)
        for comp in reversed(self._components):
            for port in comp.ports:
                if not _wait_port_free(port, comp.host):
                    errors.append(f"{comp.name} port {port} still bound after stop")
        self._components.clear()
        if self.etcd_data is not None:
            shutil.rmtree(self.etcd_data, ignore_errors=True)
        if not self.keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        if errors:
            raise ControlPlaneError("; ".join(errors))

    def restart(self, name: str) -> None:
        """SIGKILL one component ("etcd" or "kube-apiserver") and start it again on the
        same ports (etcd on the same data), as a crashed static pod comes back; returns
        once it is ready again. Clients reconnect on their own."""
        comp = next(c for c in self._components if c.name == name)
        comp.proc.kill()
        comp.proc.wait(STOP_TIMEOUT_S)
        self._components.remove(comp)
        for port in comp.ports:
            if not _wait_port_free(port, comp.host):
                raise ControlPlaneError(f"{name} port {port} still bound after SIGKILL")
        if name == "etcd":
            self._start_etcd(comp.ports)
        elif name == "kube-apiserver":
            self._start_apiserver(comp.ports[0])
        else:
            raise ValueError(f"restart supports etcd and kube-apiserver, not {name}")

    def pids(self) -> list[int]:
        return [c.proc.pid for c in self._components]

    def logs(self) -> dict[str, Path]:
        """Component name -> log file (still there after `stop()` when `log_dir` was given)."""
        return {p.stem: p for p in sorted(self.log_dir.glob("*.log"))}

    def describe_logs(self, lines: int = LOG_TAIL_LINES) -> str:
        return "\n".join(f"--- {n} ({p}) ---\n{log_tail(p, lines)}" for n, p in self.logs().items())

    def kubeconfig_for_user(self, user: str, groups: tuple[str, ...] = (), namespace: str = "default") -> Path:
        """A kubeconfig authenticating as `user` in `groups` by client certificate."""
        assert self.ca is not None, "control plane not started"
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in user)
        crt, key = self.ca.issue(f"user-{safe}", _subject(user, groups))
        return write_kubeconfig(self.dir / f"{safe}.kubeconfig", self.url, self.ca.cert,
                                cert=crt, key=key, user=user, namespace=namespace)

    def kubeconfig_for_service_account(self, namespace: str, name: str,
                                       expiration_s: int = 3600) -> Path:
        """A kubeconfig with a TokenRequest token for ServiceAccount `namespace/name`
        (which must exist): the operator then runs with exactly its RBAC."""
        out = subprocess.run(
            [str(self.bins.kubectl), "--kubeconfig", str(self.kubeconfig), "-n", namespace,
             "create", "token", name, f"--duration={expiration_s}s"],
            capture_output=True, text=True, timeout=30,
        )
        if out.returncode != 0:
            raise ControlPlaneError(f"token request for {namespace}/{name} failed: {out.stderr.strip()}")
        assert self.ca is not None
        return write_kubeconfig(self.dir / f"sa-{namespace}-{name}.kubeconfig", self.url, self.ca.cert,
                                token=out.stdout.strip(), user=f"system:serviceaccount:{namespace}:{name}",
                                namespace=namespace)

    def __enter__(self) -> "ControlPlane":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- components --

    def _make_pki(self) -> None:
        self.ca = CertificateAuthority(self.pki)
        service_ip = str(ipaddress.ip_network(self.service_cidr)[1])
        self.serving_cert, self.serving_key = self.ca.issue(
            "apiserver", "/CN=kube-apiserver", server=True, ips=(self.host, service_ip))
        self.kubelet_client_cert, self.kubelet_client_key = self.ca.issue(
            "apiserver-kubelet-client", _subject("kube-apiserver-kubelet-client", ("system:masters",)))
        self.admin_cert, self.admin_key = self.ca.issue("admin", _subject(ADMIN_USER, ("system:masters",)))
        self.sa_key = self.pki / "sa.key"
        self.sa_pub = self.pki / "sa.pub"
        _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                 "-out", self.sa_key.name, cwd=self.pki)
        _openssl("pkey", "-in", self.sa_key.name, "-pubout", "-out", self.sa_pub.name, cwd=self.pki)

    def _spawn(self, name: str, args: list[str], ports: tuple[int, ...], host: str = HOST) -> _Component:
        log = self.log_dir / f"{name}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self.dir, start_new_session=True, preexec_fn=_die_with_parent,
            )
        comp = _Component(name, proc, log, ports, host)
        self._components.append(comp)
        return comp

    def _start_etcd(self, ports: tuple[int, ...] = ()) -> None:
        client, peer = ports or (free_port(), free_port())
        if self.etcd_data is None:  # a restart keeps the data directory
            # tmpfs when there is one: etcd's fsyncs dominate apiserver write latency.
            data_root = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else self.dir
            self.etcd_data = Path(tempfile.mkdtemp(prefix="kvtier-etcd-", dir=data_root))
        self.etcd_url = f"http://{HOST}:{client}"
        comp = self._spawn("etcd", [
            str(self.bins.etcd),
            "--name=default",
            f"--data-dir={self.etcd_data}",
            f"--listen-client-urls={self.etcd_url}",
            f"--advertise-client-urls={self.etcd_url}",
            f"--listen-peer-urls=http://{HOST}:{peer}",
            f"--initial-advertise-peer-urls=http://{HOST}:{peer}",
            f"--initial-cluster=default=http://{HOST}:{peer}",
            "--unsafe-no-fsync=true",
            "--log-level=warn",
        ], (client, peer))
        self._wait(comp, ETCD_READY_TIMEOUT_S, lambda: _http_ok(f"{self.etcd_url}/health"))

    def _start_apiserver(self, port: int = 0) -> None:
        self.apiserver_port = port or free_port(self.host)
        if self.real_nodes:
            node_args = [
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                f"--kubelet-client-certificate={self.kubelet_client_cert}",
                f"--kubelet-client-key={self.kubelet_client_key}",
                # The node's address, never its name (which only an outside resolver
                # would be asked for).
                "--kubelet-preferred-address-types=InternalIP",
            ]
        else:
            node_args = [
                "--authorization-mode=RBAC",
                # envtest's choice: without it every pod needs a token volume and the
                # namespace's default ServiceAccount to exist before it can be created.
                "--disable-admission-plugins=ServiceAccount",
                "--endpoint-reconciler-type=none",
            ]
        comp = self._spawn("kube-apiserver", [
            str(self.bins.kube_apiserver),
            f"--etcd-servers={self.etcd_url}",
            f"--bind-address={self.host}",
            f"--advertise-address={self.host}",
            f"--secure-port={self.apiserver_port}",
            f"--tls-cert-file={self.serving_cert}",
            f"--tls-private-key-file={self.serving_key}",
            f"--client-ca-file={self.ca_cert}",
            f"--service-account-key-file={self.sa_pub}",
            f"--service-account-signing-key-file={self.sa_key}",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-cluster-ip-range={self.service_cidr}",
            *node_args,
            "--allow-privileged=true",
            "--profiling=false",
            f"--cert-dir={self.dir / 'apiserver-certs'}",
            "--v=1",
        ], (self.apiserver_port,), self.host)
        write_kubeconfig(self.kubeconfig, self.url, self.ca_cert, cert=self.admin_cert, key=self.admin_key)
        ctx = self.ssl_context()
        self._wait(comp, APISERVER_READY_TIMEOUT_S, lambda: _http_ok(f"{self.url}/readyz", ctx))

    def _start_controller_manager(self) -> None:
        comp = self._spawn("kube-controller-manager", [
            str(self.bins.kube_controller_manager),
            f"--kubeconfig={self.kubeconfig}",
            "--secure-port=0",
            "--leader-elect=false",
            # Real nodes: the node lifecycle controller lifts kubelet's not-ready taint
            # (and marks a node whose kubelet stopped).
            f"--controllers={','.join(CONTROLLERS + (('node-lifecycle-controller',) if self.real_nodes else ()))}",
            f"--service-account-private-key-file={self.sa_key}",
            f"--root-ca-file={self.ca_cert}",
            "--use-service-account-credentials=false",
            # Scale-ups in tests create pods right away instead of batching.
            "--concurrent-statefulset-syncs=5",
            "--v=1",
        ], ())
        ctx = self.ssl_context()
        # The serviceaccount controller creating `default` proves the informers synced
        # and the controllers run.
        self._wait(comp, CONTROLLER_MANAGER_READY_TIMEOUT_S, lambda: _http_ok(
            f"{self.url}/api/v1/namespaces/default/serviceaccounts/default", ctx))

    def ssl_context(self) -> ssl.SSLContext:
        """Trusts the CA and presents the admin client certificate."""
        ctx = ssl.create_default_context(cafile=str(self.ca_cert))
        ctx.load_cert_chain(str(self.admin_cert), str(self.admin_key))
        return ctx

    def _wait(self, comp: _Component, timeout_s: float, ready) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if comp.proc.poll() is not None:
                raise ControlPlaneError(
                    f"{comp.name} exited with {comp.proc.returncode} during start-up; "
                    f"log {comp.log}:\n{log_tail(comp.log)}")
            if ready():
                return
            time.sleep(POLL_INTERVAL_S)
        raise ControlPlaneError(
            f"{comp.name} not ready within {timeout_s:.0f}s; log {comp.log}:\n{log_tail(comp.log)}")


def _http_ok(url: str, ctx: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=ctx) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=STOP_TIMEOUT_S)


def _wait_port_free(port: int, host: str = HOST, timeout_s: float = STOP_TIMEOUT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_is_free(port, host):
            return True
        time.sleep(POLL_INTERVAL_S)
    return False
