"""Start-up and teardown of a private control plane: nothing outlives it, and a
missing build fails with the fix in the message."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier_testenv import binaries
from kvtier_testenv.controlplane import ControlPlane, port_is_free
from kvtier_testenv.kubectl import Kubectl
from kvtier_testenv.nodeagent import NodeAgent


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes: it no longer runs or holds ports.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"


@pytest.mark.k8s
def test_teardown_leaves_no_process_port_or_directory_behind() -> None:
    with ControlPlane(controller_manager=True) as cp:
        k = Kubectl(cp.kubeconfig)
        k.run("create", "namespace", "leak")
        k = k.in_namespace("leak")
        with NodeAgent(cp.kubeconfig, namespaces=["leak"], containers=["main"]) as agent:
            k.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "labels": {"app": "p"}},
                     "spec": {"containers": [{"name": "main", "image": "x", "command":
                              ["python", "-c", "import time; time.sleep(600)"]}]}})
            agent.wait_ready(1)
            pod_pids = agent.pids()
            workdir = agent.workdir
        assert len(pod_pids) == 1 and not any(pid_alive(p) for p in pod_pids)
        assert not workdir.exists()
        pids, ports = cp.pids(), [cp.apiserver_port]
        etcd_data, tmp = cp.etcd_data, cp.dir
        assert len(pids) == 3 and all(pid_alive(p) for p in pids)
    assert not any(pid_alive(p) for p in pids)
    assert all(port_is_free(p) for p in ports)
    assert not etcd_data.exists() and not tmp.exists()


def test_missing_binaries_fail_with_the_setup_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(binaries.BIN_DIR_ENV, str(tmp_path))
    (tmp_path / "etcd").write_text("#!/bin/sh\n")
    (tmp_path / "etcd").chmod(0o755)
    with pytest.raises(binaries.ControlPlaneBinariesMissing) as err:
        ControlPlane()
    message = str(err.value)
    assert "scripts/setup.sh" in message
    assert "kube-apiserver, kube-controller-manager, kubectl, helm" in message


def test_build_script_reports_the_bin_dir_it_caches_in() -> None:
    where = binaries.bin_dir()
    assert where.name == "bin" and "k8s-v1.33" in where.parent.name and "etcd-v3.5" in where.parent.name
