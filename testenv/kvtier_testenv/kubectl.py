"""The real kubectl and helm, pointed at a test kubeconfig.

    k = Kubectl(cp.kubeconfig, namespace="t-1")
    k.apply(manifest_yaml)            # str, Path, dict, or list of dicts
    pod = k.get_json("pod", "web-0")  # parsed JSON

A non-zero exit raises `KubectlError`, whose message carries the command and the
server's own words from stderr (e.g. a CRD schema violation), so a failed test
says exactly what the API server rejected.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier_testenv import binaries

DEFAULT_TIMEOUT_S = 120.0

Manifest = str | Path | dict[str, Any] | Sequence[dict[str, Any]]


class KubectlError(RuntimeError):
    """A kubectl/helm command failed; `stderr` holds what it (or the server) said."""

    def __init__(self, args: Sequence[str], returncode: int, stderr: str, stdout: str = "") -> None:
        self.args_ = list(args)
        self.returncode = returncode
        self.stderr = stderr
        self.stdout = stdout
        super().__init__(f"`{' '.join(self.args_)}` exited {returncode}: {stderr.strip()}")


def _manifest_text(manifest: Manifest) -> str:
    """YAML/JSON text for stdin: kubectl reads JSON (and multi-doc via a v1 List)."""
    if isinstance(manifest, Path):
        return manifest.read_text()
    if isinstance(manifest, str):
        return manifest
    if isinstance(manifest, dict):
        return json.dumps(manifest)
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": list(manifest)})


class _Tool:
    binary: Path
    base: list[str]
    env: dict[str, str]

    def run(self, *args: str, input: str | None = None, check: bool = True,
            timeout: float = DEFAULT_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.binary), *self.base, *args]
        out = subprocess.run(cmd, input=input, capture_output=True, text=True,
                             timeout=timeout, env=self.env)
        if check and out.returncode != 0:
            raise KubectlError(cmd, out.returncode, out.stderr, out.stdout)
        return out


class Kubectl(_Tool):
    """kubectl with `--kubeconfig` (and optionally `-n namespace`) preset."""

    def __init__(self, kubeconfig: Path | str, namespace: str | None = None,
                 binary: Path | None = None) -> None:
        self.kubeconfig = Path(kubeconfig)
        self.namespace = namespace
        self.binary = binary or binaries.find().kubectl
        self.base = ["--kubeconfig", str(self.kubeconfig)]
        if namespace:
            self.base += ["--namespace", namespace]
        self.env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def in_namespace(self, namespace: str) -> "Kubectl":
        return Kubectl(self.kubeconfig, namespace, self.binary)

    def apply(self, manifest: Manifest, *extra: str, server_side: bool = False) -> str:
        """`kubectl apply -f -`; returns kubectl's output."""
        flags = ["--server-side", "--force-conflicts"] if server_side else []
        return self.run("apply", *flags, *extra, "-f", "-", input=_manifest_text(manifest)).stdout

    def create(self, manifest: Manifest, *extra: str) -> str:
        return self.run("create", *extra, "-f", "-", input=_manifest_text(manifest)).stdout

    def delete(self, *what: str, wait: bool = False, ignore_not_found: bool = True) -> str:
        flags = [f"--wait={'true' if wait else 'false'}"]
        if ignore_not_found:
            flags.append("--ignore-not-found")
        return self.run("delete", *what, *flags).stdout

    def get_json(self, *what: str) -> dict[str, Any]:
        """`kubectl get ... -o json`, parsed."""
        return json.loads(self.run("get", *what, "-o", "json").stdout)

    def scale(self, kind_name: str, replicas: int) -> str:
        return self.run("scale", kind_name, f"--replicas={replicas}").stdout


class Helm(_Tool):
    """helm with `--kubeconfig` preset and private cache/config/data directories, so
    tests never touch (or depend on) the user's helm state."""

    def __init__(self, kubeconfig: Path | str, namespace: str | None = None,
                 binary: Path | None = None, home: Path | None = None) -> None:
        self.kubeconfig = Path(kubeconfig)
        self.binary = binary or binaries.find().helm
        self.home = Path(home) if home else Path(tempfile.mkdtemp(prefix="kvtier-helm-"))
        if not home:  # a home of its own goes with it (or at exit)
            weakref.finalize(self, shutil.rmtree, str(self.home), True)
        self.base = ["--kubeconfig", str(self.kubeconfig)]
        if namespace:
            self.base += ["--namespace", namespace]
        self.env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "HELM_CACHE_HOME": str(self.home / "cache"),
            "HELM_CONFIG_HOME": str(self.home / "config"),
            "HELM_DATA_HOME": str(self.home / "data"),
        }

    def install(self, release: str, chart: Path | str, *extra: str,
                values: dict[str, Any] | None = None, wait: bool = False) -> str:
        """`helm upgrade --install`; `values` are passed as a JSON values file."""
        args = ["upgrade", "--install", release, str(chart), *extra]
        if wait:
            args.append("--wait")
        if values is not None:
            vf = self.home / f"values-{release}.json"
            vf.parent.mkdir(parents=True, exist_ok=True)
            vf.write_text(json.dumps(values))
            args += ["--values", str(vf)]
        return self.run(*args).stdout

    def template(self, release: str, chart: Path | str, *extra: str) -> str:
        return self.run("template", release, str(chart), *extra).stdout
