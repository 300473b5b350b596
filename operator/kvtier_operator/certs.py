"""A self-signed serving certificate for the admission webhook, made with the
`openssl` binary (no Python crypto dependency). Production mounts one from a Secret
(e.g. cert-manager); tests and local runs make one here."""
from __future__ import annotations

import ipaddress
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# Long enough for any test session or demo; production certificates are rotated by
# whoever issues them.
VALID_DAYS = 30


@dataclass(frozen=True, slots=True)
class ServingCert:
    cert: Path
    key: Path

    @property
    def ca_pem(self) -> bytes:
        """Self-signed: the certificate is its own CA bundle."""
        return self.cert.read_bytes()


def self_signed(directory: Path, hosts: list[str]) -> ServingCert:
    """Write cert.pem/key.pem under `directory` for `hosts` (DNS names or IPs)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("openssl is not installed: it is needed to make the webhook's self-signed certificate")
    directory.mkdir(parents=True, exist_ok=True)
    sans = ",".join(f"IP:{h}" if _is_ip(h) else f"DNS:{h}" for h in hosts)
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", str(VALID_DAYS), "-subj", f"/CN={hosts[0]}",
         "-addext", f"subjectAltName={sans}", "-addext", "basicConstraints=critical,CA:TRUE"],
        check=True, capture_output=True,
    )
    return ServingCert(cert, key)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False
