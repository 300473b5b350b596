"""A run killed before its cluster's stop (a CI job's timeout, a developer's ^C twice)
leaves a running cluster's host state behind: containers under their shims, mounts,
network namespaces, the bridge, iptables chains, kubelet's sysctls and cgroups. A start
refuses to run beside a live cluster; once the run that left a cluster is dead, the next
start reclaims it itself, as `python -m kvtier_testenv.nodes reclaim` does."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier_testenv.nodes import CGROUP_ROOT, NETNS_DIR, SHIM_SOCKET_DIR, SYSCTLS, NodeError, _pids_naming, claim_host, leftovers, reclaim
from kvtier_testenv.polling import wait_for

# A one-node cluster's cold start plus a pod's, on a loaded 2-core machine.
START_TIMEOUT_S = 300.0

CLUSTER_SCRIPT = """
import json, sys
from kvtier_testenv.nodes import ENGINE_REPOSITORY, NodeCluster
cluster = NodeCluster(nodes=1, log_dir=sys.argv[1]).start()
[image] = [ref for ref in cluster.images() if ref.startswith(ENGINE_REPOSITORY + ":")]
cluster.kubectl("run", "idle", f"--image={image}", "--image-pull-policy=Never", "--command", "--",
                "python", "-c", "import time; time.sleep(3600)")
cluster.kubectl("wait", "--for=condition=Ready", "pod/idle", "--timeout=200s", timeout=210)
print(json.dumps({"dir": str(cluster.dir), "owned": [str(cluster.control_plane.dir),
                                                     str(cluster.control_plane.etcd_data)]}), flush=True)
sys.stdin.read()
"""


def _sysctls() -> dict[str, str]:
    return {name: Path("/proc/sys", name).read_text().strip() for name in SYSCTLS
            if Path("/proc/sys", name).exists()}


def _entries(d: Path) -> set[str]:
    return set(os.listdir(d)) if d.is_dir() else set()


@pytest.mark.nodes
def test_a_cluster_killed_before_its_stop_is_reclaimed_to_the_host_as_it_was(tmp_path):
    assert leftovers() == [], "a cluster runs here already (the node tests run one at a time)"
    sysctls = _sysctls()
    netns, shims = _entries(NETNS_DIR), _entries(SHIM_SOCKET_DIR)
    out = tmp_path / "cluster.out"
    with open(out, "w") as stdout:
        proc = subprocess.Popen([sys.executable, "-c", CLUSTER_SCRIPT, str(tmp_path / "logs")],
                                stdin=subprocess.PIPE, stdout=stdout, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        def started() -> dict | None:
            assert proc.poll() is None, f"the cluster's process exited:\n{out.read_text()[-6000:]}"
            lines = [line for line in out.read_text().splitlines() if line.startswith("{")]
            return json.loads(lines[-1]) if lines else None
        run = wait_for("a one-node cluster with a running pod", started, START_TIMEOUT_S, 0.5)
        cluster_dir = run["dir"]
        with pytest.raises(NodeError, match=f"another cluster runs here: {cluster_dir}"):
            claim_host()  # what the next start does first
        assert Path(cluster_dir).is_dir() and leftovers() != [], "a refused start touched the live cluster"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        # Its kubelet and containerd die with it (their parent-death signal); the pod's
        # shim and container do not, nor does anything its stop would have undone.
        left = leftovers()
        assert "link kvtier0" in left and "chain KVTIER-GUARD" in left, left
        assert any(item.startswith("mount ") for item in left), left
        assert _pids_naming(cluster_dir), "the pod's shim outlived the killed run"

        claim_host(log=tmp_path / "start.log")  # the run that left it is dead: reclaimed
        assert leftovers() == []
        assert "reclaimed what a dead cluster left: ['link kvtier0'" in (tmp_path / "start.log").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        reclaim()
    assert _pids_naming(cluster_dir) == []
    assert _sysctls() == sysctls
    assert _entries(NETNS_DIR) == netns and _entries(SHIM_SOCKET_DIR) == shims
    assert not Path(cluster_dir).exists()
    assert not any(Path(d).exists() for d in run["owned"]), run["owned"]  # the control plane's pki, etcd's data
    assert subprocess.run(["iptables-save"], capture_output=True, text=True).stdout.count("KUBE-") == 0


@pytest.mark.nodes
def test_a_kubelets_state_no_kvtier_cluster_made_is_refused_never_reclaimed():
    """Kubelet's pod cgroups with no trace of a kvtier cluster (no cluster dir, no
    bridge, no guard chain) are a real node's: the start refuses, naming them, and kills
    nothing."""
    assert leftovers() == [], "a cluster runs here already (the node tests run one at a time)"
    pods = next(c for c in sorted(CGROUP_ROOT.iterdir()) if c.is_dir() and not c.is_symlink()) / "kubepods"
    pods.mkdir()
    sleeper = subprocess.Popen(["sleep", "300"])
    try:
        (pods / "cgroup.procs").write_text(str(sleeper.pid))
        with pytest.raises(NodeError, match="no kvtier cluster made.*kubepods"):
            claim_host()
        assert sleeper.poll() is None, "the refused start killed a process of the foreign kubelet's pods"
    finally:
        sleeper.kill()
        sleeper.wait(timeout=30)
        wait_for("the cgroup empty", lambda: not (pods / "cgroup.procs").read_text().split(), 30, 0.1)
        pods.rmdir()
    assert leftovers() == []
