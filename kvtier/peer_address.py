"""Peer addresses (`host:port`) as the control API accepts them: strict and pure.

A peer is named the way sidecars advertise themselves in the global index and the
operator names them in warm-up requests: an IP literal (`10.0.0.7:7400`,
`[fd00::7]:7400`) or a dotted DNS name (`pod-0.serving.ns.svc:7400`). Refused, with a
message saying why: a port outside 1..65535, a missing port, a single-label name (it
resolves differently under each pod's DNS search path), labels that are not RFC 1123.
"""
from __future__ import annotations

import ipaddress
import re
from typing import NamedTuple

MAX_PORT = 65535
# RFC 1123: a whole DNS name is at most 253 characters, each label 1..63.
MAX_HOSTNAME_CHARS = 253
_LABEL_RE = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


class PeerAddress(NamedTuple):
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_peer(text: str) -> PeerAddress:
    """`host:port` -> PeerAddress; ValueError with what to fix otherwise."""
    if not isinstance(text, str):
        raise ValueError("peer address must be a string host:port")
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"peer address {text!r} must be host:port")
    if not port_text.isdigit() or len(port_text) > 5 or not (1 <= int(port_text) <= MAX_PORT):
        raise ValueError(f"peer port {port_text!r} must be an integer in 1..{MAX_PORT}")
    return PeerAddress(_host(host), int(port_text))


def _host(host: str) -> str:
    if host.startswith("[") and host.endswith("]"):
        try:
            return str(ipaddress.IPv6Address(host[1:-1]))
        except ValueError:
            raise ValueError(f"peer host {host!r} is not an IPv6 address") from None
    if ":" in host:
        raise ValueError(f"peer host {host!r}: write an IPv6 address in brackets, [addr]:port")
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    if host.replace(".", "").isdigit():
        raise ValueError(f"peer host {host!r} is not a valid IPv4 address")
    labels = host.rstrip(".").split(".")
    if len(host) > MAX_HOSTNAME_CHARS or not all(_LABEL_RE.match(label) for label in labels):
        raise ValueError(f"peer host {host!r} is not a valid DNS name (RFC 1123 labels of 1-63 letters, digits, '-')")
    if len(labels) < 2:
        raise ValueError(f"peer host {host!r} is a single-label name: use the pod IP or a dotted service name")
    return host.lower()
