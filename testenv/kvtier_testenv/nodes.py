"""A real Kubernetes cluster on this machine: the control plane of `controlplane` plus
two nodes that run pods in containers (a kubelet and a containerd + runc each, one
kube-proxy, kube-scheduler).

    with NodeCluster(log_dir=...) as cluster:
        subprocess.run([kubectl, "--kubeconfig", cluster.kubeconfig, "get", "nodes"])

What it sets up, and takes down again (`stop()`), leaving nothing behind:

- a Linux bridge `BRIDGE` holding each node's address (the first of its pod range,
  `node_pod_cidr(i)`); node 0's is also where the API server listens, so pods reach it
  through the `kubernetes` Service; a route sends `SERVICE_CIDR` to the bridge too
  (never to the default route). A pod reaches another node's pod through its gateway,
  the host, which routes between the nodes' ranges;
- pod addresses from `POD_CIDR` (the nodes' ranges together) and Service addresses from `SERVICE_CIDR`, both in
  198.18.0.0/15, which RFC 2544 reserves for benchmarking networks: nothing outside the
  machine uses it. The network rule: an iptables chain `GUARD_CHAIN`, first in OUTPUT
  and FORWARD, drops every packet to or from `GUARDED_RANGE` that would leave through
  any interface but the bridge and loopback; `guard_drops()` reads its counters, which
  a test checks stay 0;
- per node, a containerd with its own root, state, socket and CNI config under the
  cluster's temp dir (`restrict_oom_score_adj`, since this VM cannot lower
  oom_score_adj; runc with cgroupfs), the pause image, the project's image and the
  test-only reference engine's image imported into it (no registry is reachable: pods name them with pullPolicy IfNotPresent/Never);
- CoreDNS (hack/coredns.sh) as the cluster DNS, a host process on node 0's address
  reading Services and pods from the API server as `system:coredns`; every kubelet
  names it (clusterDNS), so pods resolve `<service>.<namespace>.svc.cluster.local`;
- the bridge + host-local CNI plugins (each node's addresses from its own range, kept
  under the temp dir);
- per node, a kubelet (cgroupfs, swap allowed, webhook authentication and authorization
  against the API server, its client certificate system:node:<name> for the Node
  authorizer, root, pod logs and volume plugins under the temp dir; node i > 0 under
  the cgroup root `/kvtier-node-<i>`, so that no kubelet takes another's pod cgroups
  for orphans, and with `SMALL_NODE_MEMORY` allocatable); kube-proxy in iptables mode,
  kube-scheduler.

`stop()` deletes the pods (kubelet unmounts their volumes, CNI frees their addresses,
containerd removes their network namespaces), stops every process by its pid, then
removes what is left: mounts under the temp dir, network namespaces and shim sockets
this containerd made, the iptables chains that were not there before (kubelet's and
kube-proxy's, and the guard), the bridge and its route, the host-sysctls kubelet and
the bridge change (put back to the values they had), kubelet's cgroups. A process
killed before its `stop()` leaves all of that; `reclaim()` (`python -m
kvtier_testenv.nodes reclaim`) removes it, with the host state the cluster's dir
recorded at its start (`HOST_BEFORE`). A start that finds such leftovers reclaims them
itself when no cluster that left them is alive (its owner process, `OWNER`, gone, and
no process naming its dir): a CI machine made from a snapshot of one whose run was
killed starts with a dead cluster's bridge, chains, mounts and sysctls.

The nodes share the host's network namespace, so one kube-proxy programs Services for
both (two would rewrite the same KUBE-SERVICES chains); it runs as node 0's. What a
second network namespace per node would add - each node's own iptables - no test here
needs: no Service uses a node-local traffic policy.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import ipaddress
import json
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvtier_testenv import binaries
from kvtier_testenv.controlplane import (
    ControlPlane,
    ControlPlaneError,
    _die_with_parent,
    _subject,
    log_tail,
    write_kubeconfig,
)
from kvtier_testenv.polling import WaitTimeout, wait_for
from kvtier_testenv.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
NODES_SCRIPT = REPO_ROOT / "hack" / "nodes.sh"
IMAGE_SCRIPT = REPO_ROOT / "hack" / "image.sh"
COREDNS_SCRIPT = REPO_ROOT / "hack" / "coredns.sh"

BRIDGE = "kvtier0"
GUARDED_RANGE = "198.18.0.0/15"
NODES = 2
POD_CIDR = "198.18.0.0/23"
"""Every node's pod range together: node i's is `node_pod_cidr(i)`, 198.18.i.0/24."""
SERVICE_CIDR = "198.19.0.0/24"
NODE_IP = "198.18.0.1"
"""Node 0's address, where the API server listens."""
GUARD_CHAIN = "KVTIER-GUARD"
NODE_NAME = "kvtier-node-0"
NODE_CGROUP_PREFIX = "kvtier-node-"
CLUSTER_DOMAIN = "cluster.local"
DNS_IP = NODE_IP
"""CoreDNS listens on node 0's address, port 53: the cluster DNS every kubelet names."""
DNS_READY_TIMEOUT_S = 30.0
# What CoreDNS' kubernetes plugin reads (kubeadm's system:coredns role).
COREDNS_RULES = [
    {"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"], "verbs": ["list", "watch"]},
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
]
SMALL_NODE_MEMORY = 4 << 30
"""Node i > 0's allocatable memory (the rest of the host's reserved for the system):
nodes of different sizes, as a real pool has, so DRAM fit is judged per node."""
ENGINE_REPOSITORY = "localhost/kvtier-reference-engine"
"""The reference engine's image, as hack/image.sh tags it (tag: the chart's appVersion)."""
CNI_NETWORK = "kvtier"
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
CONTAINERD = "/usr/bin/containerd"
CTR = "/usr/bin/ctr"
RUNC = "/usr/sbin/runc"
CNI_BIN_DIR = "/usr/lib/cni"
# Host settings kubelet (protectKernelDefaults off) and the bridge plugin change; put
# back on stop.
SYSCTLS = (
    "net/ipv4/ip_forward",
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)
IPTABLES = ("iptables", "ip6tables")
TABLES = ("filter", "nat", "mangle")
# Cold containerd + kubelet registration on a loaded 2-core machine: seconds; beyond
# these, fail with the logs.
CONTAINERD_READY_TIMEOUT_S = 30.0
NODE_READY_TIMEOUT_S = 120.0
IMAGE_IMPORT_TIMEOUT_S = 300.0
POD_DELETION_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0
# Where containerd 1.6 puts its shims' sockets whatever its state dir.
SHIM_SOCKET_DIR = Path("/run/containerd/s")
NETNS_DIR = Path("/run/netns")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# kubelet binds its device-plugin registration socket here whatever its --root-dir.
DEVICE_PLUGIN_SOCKET = Path("/var/lib/kubelet/device-plugins/kubelet.sock")


def node_pod_cidr(i: int) -> str:
    return f"198.18.{i}.0/24"


def node_ip(i: int) -> str:
    return f"198.18.{i}.1"


def node_name(i: int) -> str:
    return f"kvtier-node-{i}"


class NodeError(ControlPlaneError):
    """A node component failed to start or stop; carries its log tail."""


@dataclass(frozen=True, slots=True)
class NodeArtifacts:
    """What hack/nodes.sh and hack/image.sh made: binaries and image archives."""

    kubelet: Path
    kube_proxy: Path
    kube_scheduler: Path
    pause_tar: Path
    project_image_tar: Path
    engine_image_tar: Path
    """The Dockerfile's test-only `reference-engine` target (kvtier_testenv.engine_front)."""
    coredns: Path


def _script_output(script: Path, flag: str) -> Path:
    out = subprocess.run(["bash", str(script), flag], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise binaries.ControlPlaneBinariesMissing(f"{script} {flag} failed: {out.stderr.strip()}")
    return Path(out.stdout.strip())


def find_artifacts() -> NodeArtifacts:
    """The node binaries and images; raises naming the fix when any is missing."""
    bin_dir = _script_output(NODES_SCRIPT, "--print-bin-dir")
    images = _script_output(NODES_SCRIPT, "--print-images-dir")
    image = _script_output(IMAGE_SCRIPT, "--print-path")
    engine = _script_output(IMAGE_SCRIPT, "--print-engine-path")
    coredns = _script_output(COREDNS_SCRIPT, "--print-path")
    found = NodeArtifacts(bin_dir / "kubelet", bin_dir / "kube-proxy", bin_dir / "kube-scheduler",
                          images / "pause.tar", image, engine, coredns)
    missing = [str(p) for p in (found.kubelet, found.kube_proxy, found.kube_scheduler, found.coredns)
               if not os.access(p, os.X_OK)]
    missing += [str(p) for p in (found.pause_tar, found.project_image_tar, found.engine_image_tar)
                if not p.is_file()]
    for tool in (CONTAINERD, CTR, RUNC, f"{CNI_BIN_DIR}/bridge", f"{CNI_BIN_DIR}/host-local"):
        if not os.access(tool, os.X_OK):
            missing.append(tool)
    if missing:
        raise binaries.ControlPlaneBinariesMissing(
            f"real-node pieces missing: {', '.join(missing)}. Run scripts/setup.sh "
            "(hack/nodes.sh, hack/image.sh, hack/coredns.sh) to make them; the project image is rebuilt "
            "whenever its sources change.")
    return found


def _run(*args: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess:
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise NodeError(f"{' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def _read_sysctl(name: str) -> str:
    return Path("/proc/sys", name).read_text().strip()


def _write_sysctl(name: str, value: str) -> None:
    Path("/proc/sys", name).write_text(value)


# --- iptables bookkeeping ---------------------------------------------------------------


def _chains(tool: str, table: str) -> set[str]:
    out = _run(f"{tool}-save", "-t", table, check=False)
    return {line[1:].split()[0] for line in out.stdout.splitlines() if line.startswith(":")}


def _remove_chains(tool: str, table: str, keep: set[str]) -> None:
    """Deletes every chain of `table` not in `keep`, and the rules jumping to them."""
    out = _run(f"{tool}-save", "-t", table, check=False)
    if out.returncode != 0:
        return
    lines = out.stdout.splitlines()
    new = {line[1:].split()[0] for line in lines if line.startswith(":")} - keep
    if not new:
        return
    for line in lines:
        if not line.startswith("-A "):
            continue
        parts = line.split()
        chain = parts[1]
        target = parts[parts.index("-j") + 1] if "-j" in parts else None
        if chain not in new and target in new:
            # iptables-save prints rules in the syntax -D accepts (quotes included).
            subprocess.run(f"{tool} -t {table} -D {line[3:]}", shell=True, capture_output=True)
    for chain in new:
        _run(tool, "-t", table, "-F", chain, check=False)
    for chain in new:
        _run(tool, "-t", table, "-X", chain, check=False)


# --- the cluster --------------------------------------------------------------------------


@dataclass(slots=True)
class _Proc:
    name: str
    proc: subprocess.Popen
    log: Path


@dataclass
class _Node:
    """One node's pieces: its address and pod range, its containerd and its kubelet."""

    index: int
    name: str
    ip: str
    pod_cidr: str
    socket: Path
    dir: Path
    kubelet_args: list[str]
    healthz_port: int = 0

    @property
    def cgroup_root(self) -> str | None:
        """Node 0 keeps kubelet's default root ("/"); the others get their own."""
        return None if self.index == 0 else f"/{NODE_CGROUP_PREFIX}{self.index}"

    @property
    def kubelet(self) -> str:
        return "kubelet" if self.index == 0 else f"kubelet-{self.index}"

    @property
    def containerd(self) -> str:
        return "containerd" if self.index == 0 else f"containerd-{self.index}"


class NodeCluster:
    """A control plane on the bridge address and `nodes` real nodes (see the module doc).

    Invariant: after `stop()` none of its processes is alive, and the host's mounts,
    network namespaces, iptables chains, routes, links and sysctls are as before start.
    """

    def __init__(self, *, log_dir: Path | None = None, nodes: int = NODES) -> None:
        if not 1 <= nodes <= 2:
            raise ValueError("1 or 2 nodes: node ranges and the guard are sized for two")
        self.artifacts = find_artifacts()
        self.bins = binaries.find()
        # Short: containerd's socket path must stay under 108 bytes.
        self.dir = Path(tempfile.mkdtemp(prefix="kvtier-nodes-"))
        (self.dir / OWNER).write_text(json.dumps({"pid": os.getpid(), "start": _proc_start(os.getpid())}))
        self.log_dir = Path(log_dir) if log_dir else self.dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.control_plane = ControlPlane(controller_manager=True, log_dir=self.log_dir, host=NODE_IP,
                                          service_cidr=SERVICE_CIDR, real_nodes=True)
        # Short: containerd's socket path must stay under 108 bytes.
        self.nodes = [_Node(i, node_name(i), node_ip(i), node_pod_cidr(i), self.dir / f"containerd{i}.sock",
                            self.dir / f"node{i}", []) for i in range(nodes)]
        self._procs: list[_Proc] = []
        self._sysctls: dict[str, str] = {}
        self._chains_before: dict[tuple[str, str], set[str]] = {}
        self._netns_before: set[str] = set()
        self._shims_before: set[str] = set()
        self._made_bridge = False
        self._cgroup_dirs: list[Path] = []
        self.timings: dict[str, float] = {}

    # -- public --

    @property
    def kubeconfig(self) -> Path:
        return self.control_plane.kubeconfig

    @property
    def node_name(self) -> str:
        """Node 0's name."""
        return self.nodes[0].name

    @property
    def node_names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def __enter__(self) -> "NodeCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> "NodeCluster":
        t0 = time.monotonic()
        self._check_free()
        _RUNNING.add(self.dir)
        importing: concurrent.futures.Future | None = None
        pool = concurrent.futures.ThreadPoolExecutor(1)
        try:
            self._host_network()
            self._make_cgroup_roots()
            for node in self.nodes:
                self._start_containerd(node)
            # Importing (and unpacking) the images takes longest: meanwhile the control
            # plane starts.
            importing = pool.submit(self._import_images)
            self.control_plane.start()
            self._record_host_before()  # now with etcd's data directory
            self.timings["control_plane_s"] = time.monotonic() - t0
            importing.result()
            self.timings["images_imported_after_s"] = time.monotonic() - t0
            t2 = time.monotonic()
            self._start_scheduler()
            self._start_coredns()
            for node in self.nodes:
                self._start_kubelet(node)
            self._start_kube_proxy()
            for node in self.nodes:
                self._wait_node_ready(node)
            self.timings["node_ready_s"] = time.monotonic() - t2
        except BaseException:
            if importing is not None:
                with contextlib.suppress(Exception):
                    importing.result()
            self.stop()
            raise
        finally:
            pool.shutdown()
        self.timings["start_s"] = time.monotonic() - t0
        return self

    def guard_drops(self) -> dict[str, int]:
        """Packets the network rule dropped, per iptables tool and rule (0 is the rule
        holding: nothing for the cluster's ranges tried to leave through another link)."""
        counts: dict[str, int] = {}
        out = _run("iptables", "-t", "filter", "-L", GUARD_CHAIN, "-v", "-x", "-n")
        for line in out.stdout.splitlines()[2:]:
            fields = line.split()
            if len(fields) >= 3 and fields[2] == "DROP":
                counts[" ".join(fields[2:])] = int(fields[0])
        return counts

    def describe_logs(self, lines: int = 40) -> str:
        return "\n".join(f"--- {p.stem} ({p}) ---\n{log_tail(p, lines)}" for p in sorted(self.log_dir.glob("*.log")))

    def kubectl(self, *args: str, timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess:
        return _run(str(self.bins.kubectl), "--kubeconfig", str(self.kubeconfig), *args,
                    timeout=timeout, check=check)

    # -- faults a test inflicts --

    def kill_container(self, container_id: str, sig: str = "SIGKILL") -> None:
        """Signal a pod's container through containerd, as the kernel's OOM killer or a
        crash would end it: kubelet sees it exit and restarts it by the pod's policy.
        `container_id` as a pod's status gives it (`containerd://<id>`) or bare; it runs
        under exactly one node's containerd."""
        cid = container_id.removeprefix("containerd://")
        outs = [self._ctr(n, "tasks", "kill", "--signal", sig, cid, check=False) for n in self.nodes]
        if not any(o.returncode == 0 for o in outs):
            raise NodeError(f"no node's containerd could signal {cid}: " + "; ".join(o.stderr.strip() for o in outs))

    def remove_image(self, ref: str) -> None:
        """Delete an image from the node's containerd, as a node that never had it (a
        running container keeps its snapshot; a new one cannot start from it). Every node."""
        for node in self.nodes:
            self._ctr(node, "images", "rm", ref)

    def restart_kubelet(self, name: str) -> None:
        """Stop node `name`'s kubelet (SIGTERM; its pods keep running under containerd)
        and start it again with the same configuration; returns when the node is Ready again."""
        [node] = [n for n in self.nodes if n.name == name]
        [p] = [p for p in self._procs if p.name == node.kubelet]
        self._terminate(p)
        self._procs.remove(p)
        p = self._spawn_kubelet(node)

        def healthy() -> bool:
            if p.proc.poll() is not None:
                raise NodeError(f"kubelet exited with {p.proc.returncode} after its restart:\n{log_tail(p.log)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{node.healthz_port}/healthz",
                                            timeout=2) as r:
                    return r.read() == b"ok"
            except OSError:
                return False
        wait_for(f"{node.kubelet} healthy after its restart", healthy, NODE_READY_TIMEOUT_S, 0.2)
        self._wait_node_ready(node)

    def stop(self) -> None:
        _RUNNING.discard(self.dir)
        errors: list[str] = []
        t0 = time.monotonic()
        if self._procs:
            with contextlib.suppress(Exception):
                self._delete_pods()
        self.timings["stop_pods_deleted_s"] = time.monotonic() - t0
        for p in reversed(self._procs):
            self._terminate(p)
        self._procs.clear()
        self.timings["stop_processes_s"] = time.monotonic() - t0
        # Whatever kubelet could not clean up (it was stopped, or a pod hung): the
        # containerd it used is gone now, so nothing holds these any more.
        self._kill_leftover_shims()
        self._unmount_under(self.dir)
        self._remove_netns()
        self.timings["stop_unmounted_s"] = time.monotonic() - t0
        with contextlib.suppress(Exception):
            self.control_plane.stop()
        self.timings["stop_control_plane_s"] = time.monotonic() - t0
        self._restore_network(errors)
        self._restore_sysctls()
        self._remove_cgroups()
        if self._cgroup_dirs:
            errors.append(f"cgroups still hold processes after stop: {[str(d) for d in self._cgroup_dirs]}")
        self._remove_cni_cache()
        self._remove_device_plugin_socket()
        self.timings["stop_restored_s"] = time.monotonic() - t0
        if not errors:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.timings["stop_s"] = time.monotonic() - t0
        if errors:
            raise NodeError("; ".join(errors))

    # -- host network: bridge, route, the guard ------------------------------------------

    def _check_free(self) -> None:
        claim_host(exclude=self.dir, log=self.log_dir / "start.log")

    def _host_network(self) -> None:
        for tool in IPTABLES:
            for table in TABLES:
                self._chains_before[(tool, table)] = _chains(tool, table)
        self._netns_before = set(os.listdir(NETNS_DIR)) if NETNS_DIR.is_dir() else set()
        self._shims_before = set(os.listdir(SHIM_SOCKET_DIR)) if SHIM_SOCKET_DIR.is_dir() else set()
        for name in SYSCTLS:
            with contextlib.suppress(OSError):
                self._sysctls[name] = _read_sysctl(name)
        self._record_host_before()
        # The guard first, before any address of the ranges exists.
        _run("iptables", "-t", "filter", "-N", GUARD_CHAIN)
        for rule in (["-o", BRIDGE, "-j", "RETURN"], ["-o", "lo", "-j", "RETURN"],
                     ["-d", GUARDED_RANGE, "-j", "DROP"], ["-s", GUARDED_RANGE, "-j", "DROP"]):
            _run("iptables", "-t", "filter", "-A", GUARD_CHAIN, *rule)
        for chain in ("OUTPUT", "FORWARD"):
            _run("iptables", "-t", "filter", "-I", chain, "1", "-j", GUARD_CHAIN)
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        self._made_bridge = True
        for node in self.nodes:
            prefix = ipaddress.ip_network(node.pod_cidr).prefixlen
            _run("ip", "addr", "add", f"{node.ip}/{prefix}", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        # Service addresses not rewritten by kube-proxy go to the bridge, never to the
        # default route.
        _run("ip", "route", "add", SERVICE_CIDR, "dev", BRIDGE)
        # Pods reach the API server and each other's Services through the host.
        _write_sysctl("net/ipv4/ip_forward", "1")

    def _record_host_before(self) -> None:
        """What `reclaim()` puts back and removes should this process be killed before
        its stop: the host state it found, the control plane's directories."""
        cp = self.control_plane
        owned = [str(d) for d in (cp.dir, cp.etcd_data) if d is not None]
        (self.dir / HOST_BEFORE).write_text(json.dumps({
            "sysctls": self._sysctls, "netns": sorted(self._netns_before), "owned": owned,
            "chains": [[tool, table, sorted(c)] for (tool, table), c in self._chains_before.items()]}))

    def _restore_network(self, errors: list[str]) -> None:
        if self._made_bridge:
            _run("ip", "route", "del", SERVICE_CIDR, "dev", BRIDGE, check=False)
            gone, tries = _delete_bridge()
            if tries:  # what a slow delete met, for the next one to read
                with open(self.log_dir / "stop.log", "a") as log:
                    log.write(f"deleting link {BRIDGE}: {tries[:20]}\n")
            if not gone:
                errors.append(f"link {BRIDGE} still exists {BRIDGE_GONE_TIMEOUT_S:.0f} s after stop: {tries[:10]}")
            self._made_bridge = False
        for (tool, table), before in self._chains_before.items():
            _remove_chains(tool, table, before)
        self._chains_before.clear()

    def _restore_sysctls(self) -> None:
        for name, value in self._sysctls.items():
            with contextlib.suppress(OSError):
                if _read_sysctl(name) != value:
                    _write_sysctl(name, value)
        self._sysctls.clear()

    # -- processes -------------------------------------------------------------------------

    def _spawn(self, name: str, args: list[str]) -> _Proc:
        log = self.log_dir / f"{name}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=self.dir, start_new_session=True, preexec_fn=_die_with_parent)
        p = _Proc(name, proc, log)
        self._procs.append(p)
        return p

    def _check_alive(self) -> None:
        for p in self._procs:
            if p.proc.poll() is not None:
                raise NodeError(f"{p.name} exited with {p.proc.returncode}; log {p.log}:\n{log_tail(p.log)}")

    def _terminate(self, p: _Proc) -> None:
        if p.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.proc.pid, signal.SIGTERM)
        try:
            p.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.proc.pid, signal.SIGKILL)
            p.proc.wait(timeout=STOP_TIMEOUT_S)

    # -- containerd --------------------------------------------------------------------------

    def _start_containerd(self, node: _Node) -> None:
        cdir = node.dir / "containerd"
        cni_conf = node.dir / "cni" / "net.d"
        cni_conf.mkdir(parents=True)
        (cni_conf / "10-kvtier.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0",
            "name": CNI_NETWORK,
            "plugins": [
                # The bridge holds every node's gateway address already (_host_network):
                # as a gateway the plugin would refuse a bridge with another node's
                # address on it. Pods still route through their node's gateway (IPAM's).
                {"type": "bridge", "bridge": BRIDGE, "isGateway": False, "ipMasq": False,
                 "hairpinMode": True,
                 "ipam": {"type": "host-local", "dataDir": str(node.dir / "cni" / "ipam"),
                          "ranges": [[{"subnet": node.pod_cidr, "gateway": node.ip}]],
                          "routes": [{"dst": "0.0.0.0/0"}]}},
                {"type": "loopback"},
            ],
        }, indent=2))
        config = node.dir / "containerd.toml"
        config.write_text(f"""version = 2
root = "{cdir / 'root'}"
state = "{cdir / 'state'}"
plugin_dir = ""
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = "{node.socket}"
[ttrpc]
  address = "{self.dir / f'ttrpc{node.index}.sock'}"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # This VM's capability bounding set lacks CAP_SYS_RESOURCE: without it runc fails
  # every sandbox (oom_score_adj cannot be lowered).
  restrict_oom_score_adj = true
  enable_selinux = false
  disable_apparmor = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "{RUNC}"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{cni_conf}"
    max_conf_num = 1
""")
        p = self._spawn(node.containerd, [CONTAINERD, "--config", str(config), "--log-level", "warn"])
        deadline = time.monotonic() + CONTAINERD_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if p.proc.poll() is not None:
                break
            if node.socket.exists() and self._ctr(node, "version", check=False).returncode == 0:
                return
            time.sleep(0.1)
        raise NodeError(f"containerd not ready within {CONTAINERD_READY_TIMEOUT_S:.0f}s; log {p.log}:\n{log_tail(p.log)}")

    def _ctr(self, node: _Node, *args: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess:
        return _run(CTR, "--address", str(node.socket), "--namespace", "k8s.io", *args, check=check,
                    timeout=timeout)

    def _import_images(self) -> None:
        """Into every node's containerd, the nodes side by side."""
        def into(node: _Node) -> None:
            for tar in (self.artifacts.pause_tar, self.artifacts.project_image_tar, self.artifacts.engine_image_tar):
                self._ctr(node, "images", "import", str(tar), timeout=IMAGE_IMPORT_TIMEOUT_S)
        with concurrent.futures.ThreadPoolExecutor(len(self.nodes)) as pool:
            for f in [pool.submit(into, node) for node in self.nodes]:
                f.result()

    def images(self) -> list[str]:
        """The images on every node (one missing on a node is not listed)."""
        held = [set(self._ctr(node, "images", "list", "--quiet").stdout.split()) for node in self.nodes]
        return sorted(set.intersection(*held))

    # -- kubelet, kube-proxy, kube-scheduler --------------------------------------------------

    def _node_kubeconfig(self, name: str, user: str, groups: tuple[str, ...]) -> Path:
        ca = self.control_plane.ca
        assert ca is not None
        crt, key = ca.issue(name, _subject(user, groups))
        return write_kubeconfig(self.dir / f"{name}.kubeconfig", self.control_plane.url, ca.cert,
                                cert=crt, key=key, user=user)

    def _start_scheduler(self) -> None:
        kubeconfig = self._node_kubeconfig("scheduler", "system:kube-scheduler", ())
        self._spawn("kube-scheduler", [
            str(self.artifacts.kube_scheduler),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--leader-elect=false",
            f"--secure-port={free_port()}",
            "--bind-address=127.0.0.1",
            "--v=1",
        ])

    def _start_coredns(self) -> None:
        """CoreDNS (hack/coredns.sh) as the cluster DNS, a process of the host on node 0's
        address like the control plane (there is no registry to pull its image from):
        Service and pod names from the API server, read as `system:coredns` with
        kubeadm's rules; no upstream (a name outside the cluster is NXDOMAIN, never a
        query leaving the machine). Ready once a query is answered (its /ready answers
        before the DNS port is open)."""
        kubectl = [str(self.bins.kubectl), "--kubeconfig", str(self.kubeconfig)]
        role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                "metadata": {"name": "system:coredns"}, "rules": COREDNS_RULES}
        binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                   "metadata": {"name": "system:coredns"},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                               "name": "system:coredns"},
                   "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                                 "name": "system:coredns"}]}
        for obj in (role, binding):
            out = subprocess.run([*kubectl, "apply", "-f", "-"], input=json.dumps(obj), capture_output=True,
                                 text=True, timeout=60)
            if out.returncode != 0:
                raise NodeError(f"kubectl apply {obj['kind']} failed: {out.stderr.strip()}")
        kubeconfig = self._node_kubeconfig("coredns", "system:coredns", ())
        corefile = self.dir / "Corefile"
        corefile.write_text(f""".:53 {{
    bind {DNS_IP}
    errors
    ready 127.0.0.1:{free_port()}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 5
    loadbalance
}}
""")
        p = self._spawn("coredns", [str(self.artifacts.coredns), "-conf", str(corefile)])
        name = f"kubernetes.default.svc.{CLUSTER_DOMAIN}"

        def answers() -> bool:
            if p.proc.poll() is not None:
                raise NodeError(f"coredns exited with {p.proc.returncode}:\n{log_tail(p.log)}")
            return dns_a(name, DNS_IP) is not None
        try:
            wait_for(f"CoreDNS answering {name}", answers, DNS_READY_TIMEOUT_S, 0.2)
        except WaitTimeout as e:
            raise NodeError(f"{e}\n{log_tail(p.log)}") from None

    def _make_cgroup_roots(self) -> None:
        """Node i > 0's cgroup root in every hierarchy, cpuset's CPUs and memory nodes
        inherited (kubelet refuses a root that does not exist)."""
        for node in self.nodes:
            if node.cgroup_root is None:
                continue
            for controller in sorted(CGROUP_ROOT.iterdir()):
                d = controller / node.cgroup_root.lstrip("/")
                if d.is_dir():
                    raise NodeError(f"cgroup {d} exists already: another cluster runs here, or a killed run "
                                    "left it (rmdir it after checking it holds no process)")
                d.mkdir()
                self._cgroup_dirs.append(d)
                for name in ("cpuset.cpus", "cpuset.mems"):
                    if (controller / name).exists():
                        (d / name).write_text((controller / name).read_text())

    def _start_kubelet(self, node: _Node) -> None:
        kubeconfig = self._node_kubeconfig(node.kubelet, f"system:node:{node.name}", ("system:nodes",))
        kdir = node.dir / "kubelet"
        kdir.mkdir(parents=True)
        node.healthz_port = free_port()
        config = node.dir / "kubelet.yaml"
        small = {}
        if node.cgroup_root:
            total = _mem_total_bytes()
            small = {"cgroupRoot": node.cgroup_root,
                     "systemReserved": {"memory": str(max(total - SMALL_NODE_MEMORY, 0))}}
        config.write_text(json.dumps({
            **small,
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "cgroupDriver": "cgroupfs",
            "failSwapOn": False,
            "address": node.ip,
            "port": free_port(),
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": node.healthz_port,
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(self.control_plane.ca_cert)}},
            "authorization": {"mode": "Webhook"},
            "containerRuntimeEndpoint": f"unix://{node.socket}",
            "podLogsDir": str(node.dir / "pod-logs"),
            "volumePluginDir": str(node.dir / "volume-plugins"),
            # No host resolver in pods: a lookup would leave the machine (and hit the guard).
            "resolvConf": "",
            # A shared test machine: never evict or collect images because the disk or
            # memory of the whole machine runs low.
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%",
                             "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False,
            "clusterDNS": [DNS_IP],
            "clusterDomain": CLUSTER_DOMAIN,
            "registerNode": True,
            "nodeStatusUpdateFrequency": "4s",
            "syncFrequency": "5s",
            "fileCheckFrequency": "5s",
            "shutdownGracePeriod": "0s",
            "localStorageCapacityIsolation": True,
        }, indent=2))
        node.kubelet_args = [
            str(self.artifacts.kubelet),
            f"--config={config}",
            f"--kubeconfig={kubeconfig}",
            f"--root-dir={kdir}",
            f"--cert-dir={node.dir / 'kubelet-pki'}",
            f"--hostname-override={node.name}",
            f"--node-ip={node.ip}",
            "--v=1",
        ]
        self._spawn_kubelet(node)

    def _spawn_kubelet(self, node: _Node) -> _Proc:
        """Start kubelet and wait until it has bound its device-plugin socket.

        That socket's path is fixed (`DEVICE_PLUGIN_SOCKET`, not under --root-dir), so
        every kubelet on the machine binds the same file: each one first empties the
        directory, then binds. Two starting at once can both empty it and then both
        bind, and the second dies with "address already in use". So kubelets start one
        at a time: the socket is removed, the kubelet spawned, and the next one starts
        only once the file is back (bound by this kubelet)."""
        with contextlib.suppress(FileNotFoundError):
            DEVICE_PLUGIN_SOCKET.unlink()
        p = self._spawn(node.kubelet, node.kubelet_args)

        def bound() -> bool:
            self._check_alive()
            return DEVICE_PLUGIN_SOCKET.is_socket()
        try:
            wait_for(f"{node.kubelet} bound {DEVICE_PLUGIN_SOCKET}", bound, NODE_READY_TIMEOUT_S, 0.05)
        except WaitTimeout as e:
            raise NodeError(f"{e}\n{log_tail(p.log)}") from None
        return p

    def _start_kube_proxy(self) -> None:
        kubeconfig = self._node_kubeconfig("kube-proxy", "system:kube-proxy", ())
        config = self.dir / "kube-proxy.yaml"
        config.write_text(json.dumps({
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "mode": "iptables",
            "clientConnection": {"kubeconfig": str(kubeconfig)},
            "hostnameOverride": self.nodes[0].name,
            "bindAddress": NODE_IP,
            "clusterCIDR": POD_CIDR,
            "healthzBindAddress": f"127.0.0.1:{free_port()}",
            "metricsBindAddress": f"127.0.0.1:{free_port()}",
            "nodePortAddresses": [POD_CIDR],
            "iptables": {"localhostNodePorts": False, "masqueradeAll": False, "syncPeriod": "5s",
                         "minSyncPeriod": "0s"},
            # The host's conntrack sysctls stay as they are.
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                          "tcpCloseWaitTimeout": "0s"},
        }, indent=2))
        self._spawn("kube-proxy", [str(self.artifacts.kube_proxy), f"--config={config}", "--v=1"])

    def _wait_node_ready(self, node: _Node) -> None:
        def ready() -> bool:
            self._check_alive()
            out = self.kubectl("get", "node", node.name, "-o", "json", check=False)
            if out.returncode != 0:
                return False
            obj = json.loads(out.stdout)
            conds = obj.get("status", {}).get("conditions", [])
            # Schedulable too: the node lifecycle controller lifted the not-ready taint.
            return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds) and not any(
                t.get("key") == "node.kubernetes.io/not-ready" for t in obj.get("spec", {}).get("taints") or [])
        try:
            wait_for(f"node {node.name} Ready", ready, NODE_READY_TIMEOUT_S, 0.5)
        except WaitTimeout as e:
            raise NodeError(f"{e}\n{self.describe_logs()}") from None

    # -- teardown helpers ------------------------------------------------------------------------

    def _delete_pods(self) -> None:
        """Every pod's deletion through kubelet (it unmounts volumes and frees addresses)."""
        if not any(p.name.startswith("kubelet") and p.proc.poll() is None for p in self._procs):
            return
        # The workloads first, their pods orphaned (the controllers would recreate them,
        # and a cascading delete gives each pod its own grace period: a sidecar drains
        # for up to its drain timeout, and a PID 1 with no SIGTERM handler waits out
        # the whole of it); then every pod with one second's grace.
        self.kubectl("delete", "statefulsets,deployments,replicasets,daemonsets,jobs", "--all",
                     "--all-namespaces", "--cascade=orphan", "--wait=false", check=False)
        self.kubectl("delete", "pods", "--all", "--all-namespaces", "--wait=false",
                     "--grace-period=1", check=False)

        def none_left() -> bool:
            out = self.kubectl("get", "pods", "--all-namespaces", "-o", "name", check=False)
            return out.returncode == 0 and not out.stdout.strip()
        with contextlib.suppress(WaitTimeout):
            wait_for("all pods deleted", none_left, POD_DELETION_TIMEOUT_S, 0.5)

    def _kill_leftover_shims(self) -> None:
        """containerd-shim processes of these containerds (their -address names its socket)."""
        for node in self.nodes:
            for pid in _pids_naming(str(node.socket), whole_arg=True):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if SHIM_SOCKET_DIR.is_dir():
            for name in set(os.listdir(SHIM_SOCKET_DIR)) - self._shims_before:
                with contextlib.suppress(OSError):
                    (SHIM_SOCKET_DIR / name).unlink()

    def _remove_netns(self) -> None:
        _remove_netns_since(self._netns_before)

    @staticmethod
    def _unmount_under(root: Path) -> None:
        prefix = str(root) + "/"
        mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
        for target in sorted((m for m in mounts if m.startswith(prefix)), key=len, reverse=True):
            _run("umount", "-l", target, check=False)

    def _remove_cgroups(self) -> None:
        """The kubelets' `kubepods` hierarchies, once no process is left in them, and the
        nodes' own cgroup roots."""
        for controller in CGROUP_ROOT.iterdir():
            tops = [controller / "kubepods"] + [d / "kubepods" for d in controller.glob(f"{NODE_CGROUP_PREFIX}*")]
            for top in tops:
                if top.is_dir():
                    _rmdir_tree(top)
        for d in reversed(self._cgroup_dirs):
            with contextlib.suppress(OSError):
                d.rmdir()
        self._cgroup_dirs = [d for d in self._cgroup_dirs if d.is_dir()]

    @staticmethod
    def _remove_device_plugin_socket() -> None:
        """The socket kubelet left at its fixed path, and its directories if empty."""
        with contextlib.suppress(FileNotFoundError):
            DEVICE_PLUGIN_SOCKET.unlink()
        for d in (DEVICE_PLUGIN_SOCKET.parent, DEVICE_PLUGIN_SOCKET.parent.parent):
            with contextlib.suppress(OSError):
                d.rmdir()

    @staticmethod
    def _remove_cni_cache() -> None:
        """libcni's result cache (always /var/lib/cni/results) for this network."""
        results = Path("/var/lib/cni/results")
        if results.is_dir():
            for f in results.glob(f"{CNI_NETWORK}-*"):
                with contextlib.suppress(OSError):
                    f.unlink()


def dns_a(name: str, server: str, timeout_s: float = 1.0) -> str | None:
    """The first A record a DNS server at `server`:53 gives for `name` (one UDP query),
    or None: no answer in time, or none in it."""
    qid = random.randrange(1 << 16)
    question = b"".join(bytes([len(p)]) + p.encode() for p in name.rstrip(".").split(".")) + b"\0"
    query = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0) + question + struct.pack(">HH", 1, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.sendto(query, (server, 53))
            reply = sock.recv(4096)
        except OSError:
            return None
    rid, flags, _qd, ancount = struct.unpack(">HHHH", reply[:8])
    if rid != qid or flags & 0xF or not ancount:
        return None
    at = 12 + len(question) + 4
    for _ in range(ancount):
        while reply[at] and reply[at] < 0xC0:  # a name: labels, or a pointer
            at += reply[at] + 1
        at += 2 if reply[at] >= 0xC0 else 1
        rtype, _cls, _ttl, length = struct.unpack(">HHIH", reply[at : at + 10])
        at += 10
        if rtype == 1 and length == 4:
            return socket.inet_ntoa(reply[at : at + 4])
        at += length
    return None


def _mem_total_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise NodeError("no MemTotal in /proc/meminfo")


HOST_BEFORE = "host-before.json"
"""In a cluster's dir: the host's sysctls, network namespaces and iptables chains as
they were before its start, for `reclaim()`."""
OWNER = "owner.json"
"""In a cluster's dir: the pid and start time of the process that made it."""
BRIDGE_GONE_TIMEOUT_S = 30.0
"""How long a deleted bridge may linger (a CNI plugin still running, the kernel still
unregistering its ports) before a stop or a start calls it left behind."""


def _proc_start(pid: int) -> str | None:
    """A live process's start time (clock ticks since boot): with its pid, who it is.
    None for no such process, or a zombie (killed, not yet reaped by its parent)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[19] if len(fields) > 19 and fields[0] not in ("Z", "X") else None


_RUNNING: set[Path] = set()
"""The dirs of this process's clusters between their start and their stop."""


def _live_clusters(exclude: Path | None = None) -> list[tuple[Path, int]]:
    """Cluster dirs whose run is alive: its owner process (`OWNER`) alive, and for this
    process only a cluster not stopped yet; a dir with no owner record (an older
    checkout's), a kubelet or containerd naming it (a killed run's shims outlive it)."""
    live = []
    for d in _cluster_dirs(exclude):
        try:
            owner = json.loads((d / OWNER).read_text())
        except (OSError, ValueError):
            owner = None
        if owner is not None:
            if owner.get("pid") == os.getpid():
                alive = d in _RUNNING
            else:
                alive = owner.get("start") is not None and _proc_start(owner.get("pid", 0)) == owner["start"]
            if alive:
                live.append((d, owner["pid"]))
            continue
        for pid in _pids_naming(str(d)):
            with contextlib.suppress(OSError):
                if Path(os.readlink(f"/proc/{pid}/exe")).name in ("kubelet", "containerd"):
                    live.append((d, pid))
                    break
    return live


def claim_host(exclude: Path | None = None, log: Path | None = None) -> None:
    """What a cluster's start does first: refuses to run beside a live cluster
    (`_live_clusters`), and reclaims what a dead one left (`reclaim`), naming it in
    `log`. `exclude`: the starting cluster's own dir."""
    left_before = leftovers()
    if not left_before:
        return
    if not (_cluster_dirs(exclude) or f"link {BRIDGE}" in left_before or f"chain {GUARD_CHAIN}" in left_before):
        # Kubelet's cgroups or kube-proxy's chains with no trace of a kvtier cluster: a
        # real node's, never ours to kill.
        raise NodeError(f"this host has a kubelet's or kube-proxy's state no kvtier cluster made: {left_before}")
    if live := _live_clusters(exclude=exclude):
        if _bridge_gone_within(BRIDGE_GONE_TIMEOUT_S) and GUARD_CHAIN not in _chains("iptables", "filter"):
            return  # a cluster of this process stopping: its bridge lingered
        raise NodeError(f"another cluster runs here: {', '.join(f'{d} (pid {pid})' for d, pid in live)}")
    left = reclaim(exclude=exclude)
    if log is not None:
        with log.open("a") as f:
            f.write(f"reclaimed what a dead cluster left: {left_before}\n")
    if left:
        raise NodeError(f"a dead cluster's leftovers would not go: {left}")


def _pids_naming(text: str, *, whole_arg: bool = False) -> list[int]:
    """Processes (other than this one) whose command line contains `text` (with
    `whole_arg`, as one of its arguments)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            with contextlib.suppress(OSError):
                cmdline = (d / "cmdline").read_bytes().decode(errors="replace")
                if text in (cmdline.split("\0") if whole_arg else cmdline):
                    pids.append(int(d.name))
    return pids


def _cluster_dirs(exclude: Path | None = None) -> list[Path]:
    """Every cluster's dir on this host but `exclude`."""
    return [d for d in Path(tempfile.gettempdir()).glob("kvtier-nodes-*") if d != exclude]


def _bridge_exists() -> bool:
    out = _run("ip", "link", "show", BRIDGE, check=False)
    if out.returncode != 0 and "does not exist" not in out.stderr:
        raise NodeError(f"ip link show {BRIDGE} failed ({out.returncode}): {out.stderr.strip()}")
    return out.returncode == 0


def _bridge_gone_within(timeout_s: float) -> bool:
    with contextlib.suppress(WaitTimeout):
        wait_for(f"link {BRIDGE} gone", lambda: not _bridge_exists(), timeout_s, 0.2)
        return True
    return False


def _cni_plugin_pids() -> list[int]:
    """CNI plugins still running (a sandbox's ADD or DEL that containerd started)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(d / "exe").startswith(CNI_BIN_DIR + "/"):
                    pids.append(int(d.name))
    return pids


def _delete_bridge() -> tuple[bool, list[str]]:
    """Deletes the bridge, until it stays gone: a CNI plugin that containerd left
    running (its ADD) would make it again, so those go first. Whether it is gone, and
    what each try met (a failed delete, a plugin killed, the link back after a delete)."""
    tries: list[str] = []

    def gone() -> bool:
        if plugins := _cni_plugin_pids():
            tries.append(f"killed CNI plugins {plugins}")
            for pid in plugins:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if _bridge_exists():
            out = _run("ip", "link", "del", BRIDGE, check=False)
            if out.returncode != 0:
                tries.append(f"ip link del: rc {out.returncode} {out.stderr.strip()}")
        if not _bridge_exists():
            return True
        tries.append("still there after a delete")
        return False
    with contextlib.suppress(WaitTimeout):
        wait_for(f"link {BRIDGE} deleted", gone, BRIDGE_GONE_TIMEOUT_S, 0.2)
        return True, tries
    detail = _run("ip", "-d", "link", "show", BRIDGE, check=False)
    ports = _run("ip", "-br", "link", "show", "master", BRIDGE, check=False)
    tries += [detail.stdout.strip(), f"ports: {ports.stdout.strip() or 'none'}"]
    return False, tries


def _remove_netns_since(before: set[str]) -> None:
    """The CNI network namespaces made since `before` (their bind mounts, their files)."""
    if not NETNS_DIR.is_dir():
        return
    for name in set(os.listdir(NETNS_DIR)) - before:
        if name.startswith("cni-"):
            _run("umount", "-l", str(NETNS_DIR / name), check=False)
            with contextlib.suppress(OSError):
                (NETNS_DIR / name).unlink()


def _rmdir_tree(top: Path) -> None:
    """A cgroup hierarchy, deepest first (a cgroup with a process left stays)."""
    for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            d.rmdir()
    with contextlib.suppress(OSError):
        top.rmdir()


# A serving pod's securityContext under PodSecurity `restricted`: the pod's, its containers'.
RESTRICTED_POD = {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
                  "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
              "readOnlyRootFilesystem": True, "runAsNonRoot": True}


def redis_service(kubectl, namespace: str, port: int) -> str:
    """A Redis on the host (listening on NODE_IP:`port`) as users name one: a selectorless
    Service in `namespace` whose EndpointSlice is the host's server, which the cluster DNS
    resolves to the Service's address and kube-proxy's rules reach. Returns its redis:// URL."""
    kubectl = kubectl.in_namespace(namespace)
    kubectl.apply({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "redis", "namespace": namespace},
                   "spec": {"ports": [{"name": "redis", "port": 6379, "targetPort": port}]}})
    kubectl.apply({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                   "metadata": {"name": "redis-host", "namespace": namespace,
                                "labels": {"kubernetes.io/service-name": "redis"}},
                   "addressType": "IPv4", "endpoints": [{"addresses": [NODE_IP]}],
                   "ports": [{"name": "redis", "port": port, "protocol": "TCP"}]})
    service = f"redis.{namespace}.svc.{CLUSTER_DOMAIN}"
    cluster_ip = kubectl.get_json("service", "redis")["spec"]["clusterIP"]
    resolved = wait_for(f"the cluster DNS resolving {service}", lambda: dns_a(service, DNS_IP), 30, 0.5)
    if resolved != cluster_ip:
        raise NodeError(f"the cluster DNS resolves {service} to {resolved}, not its Service's {cluster_ip}")
    return f"redis://{service}:6379/0"


# The injected sidecar's container name (kvtier.names.SIDECAR_CONTAINER; the test
# environment does not import the operator's names).
SIDECAR_CONTAINER = "kvtier-sidecar"
WEBHOOK_READY_TIMEOUT_S = 90.0


def wait_webhook_injects(kubectl, namespace: str, workload: dict, timeout_s: float = WEBHOOK_READY_TIMEOUT_S
                         ) -> None:
    """Until the chart's webhook, called through its Service, injects the sidecar into a
    pod of `workload` (a StatefulSet or Deployment manifest whose pods a policy selects):
    a server-side dry run of one such pod comes back with it. The operator pod turns
    Ready before kube-proxy's rules lead the webhook's Service to it, and the chart's
    `failurePolicy: Ignore` admits a pod created meanwhile without the sidecar (the
    policy's status counts it in uninjectedPods). Raises WaitTimeout naming the last answer."""
    template = workload["spec"]["template"]
    probe = {"apiVersion": "v1", "kind": "Pod", "spec": template["spec"], "metadata": {
        **template["metadata"], "name": f"{workload['metadata']['name']}-injection-probe", "namespace": namespace}}
    seen: list[str] = []

    def injected() -> bool:
        out = kubectl.in_namespace(namespace).run("create", "--dry-run=server", "-o", "json", "-f", "-",
                                                  input=json.dumps(probe), check=False)
        if out.returncode != 0:
            seen[:] = [out.stderr.strip()]
            return False
        spec = json.loads(out.stdout)["spec"]
        seen[:] = [c["name"] for c in spec.get("initContainers", []) + spec["containers"]]
        return SIDECAR_CONTAINER in seen
    try:
        wait_for("the webhook injecting through its Service (a server-side dry run)", injected, timeout_s, 0.5)
    except WaitTimeout as e:
        raise WaitTimeout(f"{e}: last answer {seen}") from None


def leftovers() -> list[str]:
    """What a stopped cluster must not leave: the bridge, the guard chain, kubelet's
    cgroups, processes of the node binaries, mounts of a kvtier-nodes dir."""
    found = []
    if _bridge_exists():
        found.append(f"link {BRIDGE}")
    if GUARD_CHAIN in _chains("iptables", "filter"):
        found.append(f"chain {GUARD_CHAIN}")
    for tool in IPTABLES:
        for table in TABLES:
            found += [f"{tool} {table} {c}" for c in _chains(tool, table) if re.match(r"KUBE-", c)]
    for controller in CGROUP_ROOT.iterdir():
        if (controller / "kubepods").is_dir():
            found.append(f"cgroup {controller / 'kubepods'}")
        found += [f"cgroup {d}" for d in controller.glob(f"{NODE_CGROUP_PREFIX}*")]
    if DEVICE_PLUGIN_SOCKET.exists():
        found.append(f"socket {DEVICE_PLUGIN_SOCKET}")
    for line in Path("/proc/self/mounts").read_text().splitlines():
        if "/kvtier-nodes-" in line.split()[1]:
            found.append(f"mount {line.split()[1]}")
    return found


def reclaim(exclude: Path | None = None) -> list[str]:
    """Removes what a killed run left (a process killed before its `stop()`), then
    returns `leftovers()`. Only for a machine where no cluster runs: it kills every
    process naming a cluster dir (`kvtier-nodes-*`: containerd, kubelet, their shims)
    and every process in the nodes' pod cgroups, then unmounts, deletes and puts back
    what `stop()` would have, with the host state each dir recorded at its start.
    `exclude`: the dir of a cluster about to start, kept."""
    dirs = _cluster_dirs(exclude)
    doomed: set[int] = set(_pids_naming("/kvtier-nodes-"))
    cgroups = [c for controller in CGROUP_ROOT.iterdir()
               for c in [controller / "kubepods", *controller.glob(f"{NODE_CGROUP_PREFIX}*")] if c.is_dir()]
    for top in cgroups:
        for procs in top.rglob("cgroup.procs"):
            with contextlib.suppress(OSError, ValueError):
                doomed.update(int(pid) for pid in procs.read_text().split())
    doomed.update(_cni_plugin_pids())
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(WaitTimeout):
        wait_for("the killed run's processes gone", lambda: not any(Path(f"/proc/{p}").exists() for p in doomed),
                 STOP_TIMEOUT_S, 0.2)
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    for target in sorted((m for m in mounts if "/kvtier-nodes-" in m), key=len, reverse=True):
        _run("umount", "-l", target, check=False)
    netns_before: set[str] = set()
    chains_before: dict[tuple[str, str], set[str]] = {}
    sysctls: dict[str, str] = {}
    records = []
    for d in dirs:
        with contextlib.suppress(OSError, ValueError):
            records.append(((d / HOST_BEFORE).stat().st_mtime, json.loads((d / HOST_BEFORE).read_text())))
    if records:  # the oldest record: the host before any of these runs
        before = min(records, key=lambda r: r[0])[1]
        netns_before = set(before["netns"])
        chains_before = {(tool, table): set(c) for tool, table, c in before["chains"]}
        sysctls = before["sysctls"]
    _remove_netns_since(netns_before)
    _run("ip", "route", "del", SERVICE_CIDR, "dev", BRIDGE, check=False)
    _delete_bridge()
    for tool in IPTABLES:
        for table in TABLES:
            keep = chains_before.get((tool, table))
            if keep is None:  # no record: every kubelet, kube-proxy and guard chain goes
                keep = {c for c in _chains(tool, table) if not c.startswith("KUBE-") and c != GUARD_CHAIN}
            _remove_chains(tool, table, keep)
    for name, value in sysctls.items():
        with contextlib.suppress(OSError):
            if _read_sysctl(name) != value:
                _write_sysctl(name, value)
    for top in cgroups:
        _rmdir_tree(top)
    NodeCluster._remove_cni_cache()
    NodeCluster._remove_device_plugin_socket()
    if SHIM_SOCKET_DIR.is_dir():  # the killed shims' sockets: nothing listens on them
        for sock in SHIM_SOCKET_DIR.iterdir():
            with socket.socket(socket.AF_UNIX) as probe, contextlib.suppress(OSError):
                try:
                    probe.connect(str(sock))
                except ConnectionRefusedError:
                    sock.unlink()
    left = leftovers()
    if not left:
        for _, record in records:  # the killed control planes' certificates and etcd data
            for d in record.get("owned", []):
                if Path(d).name.startswith(("kvtier-controlplane-", "kvtier-etcd-")):
                    shutil.rmtree(d, ignore_errors=True)
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    return left


if __name__ == "__main__":
    import sys
    if sys.argv[1:] != ["reclaim"]:
        sys.exit("usage: python -m kvtier_testenv.nodes reclaim   (what a killed run left; no cluster may run)")
    left = reclaim()
    print("\n".join(left) if left else "nothing left")
    sys.exit(1 if left else 0)

