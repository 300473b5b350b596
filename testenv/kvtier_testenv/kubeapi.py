"""A minimal Kubernetes REST client for the node agent: raw JSON over HTTPS with a
kubeconfig's credentials (no model deserialisation in a 0.2 s loop), and a per-pass
cache of one namespace's ConfigMaps and Secrets."""
from __future__ import annotations

import base64
import http.client
import json
import shutil
import ssl
import tempfile
import threading
import urllib.parse
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

HTTP_TIMEOUT_S = 10.0


class ApiError(RuntimeError):
    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        self.status = status
        super().__init__(f"{method} {path} -> {status}: {body[:500]}")


class RestClient:
    """JSON over HTTPS with the credentials of a kubeconfig's current context."""

    def __init__(self, kubeconfig: Path | str) -> None:
        cfg = yaml.safe_load(Path(kubeconfig).read_text())
        ctx_name = cfg["current-context"]
        ctx = next(c["context"] for c in cfg["contexts"] if c["name"] == ctx_name)
        cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == ctx["cluster"])
        user = next(u["user"] for u in cfg["users"] if u["name"] == ctx["user"])
        url = urllib.parse.urlsplit(cluster["server"])
        self.host, self.port = url.hostname, url.port or 443
        self._tmp = Path(tempfile.mkdtemp(prefix="kvtier-rest-"))
        # The decoded credentials go with the client, closed or not (or at exit).
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self._tmp), True)
        ca = self._file(cluster, "certificate-authority")
        self.ctx = ssl.create_default_context(cafile=ca)
        cert, key = self._file(user, "client-certificate"), self._file(user, "client-key")
        if cert and key:
            self.ctx.load_cert_chain(cert, key)
        self.headers = {"Accept": "application/json"}
        if user.get("token"):
            self.headers["Authorization"] = f"Bearer {user['token']}"
        self._local = threading.local()

    def _file(self, section: Mapping[str, Any], name: str) -> str | None:
        if section.get(name):
            return section[name]
        data = section.get(f"{name}-data")
        if not data:
            return None
        path = self._tmp / name
        path.write_bytes(base64.b64decode(data))
        return str(path)

    def _conn(self) -> http.client.HTTPSConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPSConnection(self.host, self.port, context=self.ctx, timeout=HTTP_TIMEOUT_S)
            self._local.conn = conn
        return conn

    def request(self, method: str, path: str, body: Any = None,
                content_type: str = "application/json") -> Any:
        payload = None if body is None else json.dumps(body).encode()
        headers = dict(self.headers)
        if payload is not None:
            headers["Content-Type"] = content_type
        for attempt in (0, 1):  # one retry on a dropped keep-alive connection
            conn = self._conn()
            try:
                conn.request(method, path, body=payload, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                break
            except (http.client.HTTPException, OSError):
                conn.close()
                self._local.conn = None
                if attempt:
                    raise
        if resp.status >= 400:
            raise ApiError(method, path, resp.status, data.decode(errors="replace"))
        return json.loads(data) if data else None

    def get(self, path: str, **query: str) -> Any:
        q = {k: v for k, v in query.items() if v}
        return self.request("GET", path + (f"?{urllib.parse.urlencode(q)}" if q else ""))

    def get_or_none(self, path: str) -> Any:
        try:
            return self.get(path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._cleanup()


class ObjectLookup:
    """ConfigMap/Secret data of one namespace, fetched once per reconcile pass."""

    def __init__(self, rest: RestClient, namespace: str) -> None:
        self.rest, self.namespace = rest, namespace
        self._seen: dict[tuple[str, str], dict[str, Any] | None] = {}

    def object(self, kind: str, name: str) -> dict[str, Any] | None:
        key = (kind, name)
        if key not in self._seen:
            plural = "configmaps" if kind == "ConfigMap" else "secrets"
            self._seen[key] = self.rest.get_or_none(f"/api/v1/namespaces/{self.namespace}/{plural}/{name}")
        return self._seen[key]

    def data(self, kind: str, name: str) -> dict[str, str] | None:
        """String values; Secret data (base64) and ConfigMap binaryData decoded."""
        obj = self.object(kind, name)
        if obj is None:
            return None
        return {k: v.decode(errors="replace") for k, v in self.data_bytes(obj, kind).items()}

    @staticmethod
    def data_bytes(obj: Mapping[str, Any], kind: str) -> dict[str, bytes]:
        if kind == "Secret":
            out = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
            out.update({k: v.encode() for k, v in (obj.get("stringData") or {}).items()})
            return out
        out = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        out.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
        return out
