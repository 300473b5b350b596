"""Rendering charts/kvtier with the real helm binary (no cluster), and reading what
came out: objects by kind and name, and the webhook's certificates via openssl."""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml

from kvtier_testenv import binaries

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvtier"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class HelmFailed(AssertionError):
    def __init__(self, args: list[str], proc: subprocess.CompletedProcess[str]) -> None:
        self.stderr = proc.stderr
        super().__init__(f"helm {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")


def helm(*args: str, values: dict[str, Any] | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """The real helm with private cache/config/data dirs and an optional values file."""
    with tempfile.TemporaryDirectory(prefix="kvtier-helm-") as home:
        env = {**os.environ, "HELM_CACHE_HOME": f"{home}/cache", "HELM_CONFIG_HOME": f"{home}/config",
               "HELM_DATA_HOME": f"{home}/data"}
        argv = list(args)
        if values is not None:
            vf = Path(home) / "values.json"
            vf.write_text(json.dumps(values))
            argv += ["--values", str(vf)]
        proc = subprocess.run([str(binaries.find().helm), *argv], capture_output=True, text=True, env=env, timeout=120)
    if check and proc.returncode != 0:
        raise HelmFailed(argv, proc)
    return proc


def render(values: dict[str, Any] | None = None, release: str = "kvtier",
           namespace: str = "kvtier-system", extra: list[str] | None = None) -> dict[tuple[str, str], dict[str, Any]]:
    """`helm template` -> {(kind, name): object}; `extra`: more helm flags."""
    out = helm("template", release, str(CHART), "--namespace", namespace, *(extra or []), values=values).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    objects = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert len(objects) == len(docs), "two rendered objects share a kind and name"
    return objects


def operator_container(objects: dict[tuple[str, str], dict[str, Any]], name: str = "kvtier-operator") -> dict[str, Any]:
    [container] = objects[("Deployment", name)]["spec"]["template"]["spec"]["containers"]
    return container


def flags(container: dict[str, Any]) -> dict[str, str]:
    """--name=value arguments as a dict (repeated flags: the last one)."""
    return dict(a[2:].split("=", 1) if "=" in a else (a[2:], "") for a in container["args"])


def cert_sans(cert_pem: bytes, workdir: Path) -> set[str]:
    """The certificate's subjectAltName entries as openssl prints them (DNS:x, IP Address:y)."""
    path = workdir / "cert.pem"
    path.write_bytes(cert_pem)
    out = subprocess.run(["openssl", "x509", "-in", str(path), "-noout", "-ext", "subjectAltName"],
                         capture_output=True, text=True, check=True).stdout
    return {part.strip() for line in out.splitlines()[1:] for part in line.split(",") if part.strip()}


def verifies(cert_pem: bytes, ca_pem: bytes, workdir: Path) -> bool:
    """openssl verify: does `ca_pem` sign `cert_pem` (as a server certificate)?"""
    (workdir / "leaf.pem").write_bytes(cert_pem)
    (workdir / "ca.pem").write_bytes(ca_pem)
    proc = subprocess.run(["openssl", "verify", "-purpose", "sslserver", "-CAfile", str(workdir / "ca.pem"),
                           str(workdir / "leaf.pem")], capture_output=True, text=True)
    return proc.returncode == 0
