"""Where the control-plane binaries built by `hack/controlplane.sh` live.

The build script owns the cache key (Kubernetes, etcd, kubectl-layer and Go
versions, plus a digest of the wrapper modules); this module asks it for the
directory rather than recomputing the key, so the two can never disagree.
`KVTIER_CONTROLPLANE_BIN` overrides the lookup (a directory holding all five).

A missing binary raises `ControlPlaneBinariesMissing` telling the user to run
`scripts/setup.sh`: tests that need the control plane fail, they never skip.
"""
from __future__ import annotations

import functools
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

BIN_DIR_ENV = "KVTIER_CONTROLPLANE_BIN"
REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "hack" / "controlplane.sh"
NAMES = ("etcd", "kube-apiserver", "kube-controller-manager", "kubectl", "helm")


class ControlPlaneBinariesMissing(RuntimeError):
    """The control plane has not been built (or the cache was removed)."""


@dataclass(frozen=True, slots=True)
class Binaries:
    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kubectl: Path
    helm: Path

    @property
    def bin_dir(self) -> Path:
        return self.etcd.parent


def bin_dir() -> Path:
    """The cache directory the build script uses for the current versions."""
    explicit = os.environ.get(BIN_DIR_ENV)
    return Path(explicit) if explicit else _script_bin_dir()


@functools.cache
def _script_bin_dir() -> Path:
    if not BUILD_SCRIPT.is_file():
        raise ControlPlaneBinariesMissing(f"{BUILD_SCRIPT} is missing; is this a kvtier checkout?")
    out = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--print-bin-dir"],
        capture_output=True, text=True, timeout=60,
    )
    if out.returncode != 0:
        raise ControlPlaneBinariesMissing(
            f"{BUILD_SCRIPT} --print-bin-dir failed ({out.returncode}): {out.stderr.strip()}"
        )
    return Path(out.stdout.strip())


def find() -> Binaries:
    """All five binaries; raises `ControlPlaneBinariesMissing` naming the fix."""
    where = bin_dir()
    missing = [n for n in NAMES if not os.access(where / n, os.X_OK)]
    if missing:
        raise ControlPlaneBinariesMissing(
            f"Kubernetes control-plane binaries missing from {where}: {', '.join(missing)}. "
            "Run scripts/setup.sh (or bash hack/controlplane.sh) to build them once; "
            f"or point {BIN_DIR_ENV} at a directory holding {', '.join(NAMES)}."
        )
    return Binaries(*(where / n for n in NAMES))
