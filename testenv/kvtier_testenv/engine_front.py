"""An OpenAI-compatible HTTP front for the reference engine, run as a test pod's engine
container (the node agent runs it next to the injected sidecar): `POST /v1/completions`
with a prompt of token ids runs the reference engine's prefill through the pod's own
sidecar, as the vLLM connector would — look the prompt up, load a hit, report, and store
the KV of every whole block the sidecar did not give (`synthetic.prefill_kv`: the KV is
a pure function of the key root and the tokens). Every hit's loaded bytes are checked
against that recompute: a mismatch is answered 500 and never computed with. The request's `cache_salt` names the tenant (the connector's rule), and its
`kv_transfer_params` may mark it as the rollout's warm-up (`names.is_warmup`, as the
connector reads it): its lookup then carries purpose "warmup" and it is not reported,
so the sidecar counts it apart from traffic. What the rollout's warm-before-ready
calls; `GET /health` answers once the sidecar's socket does.

    python -m kvtier_testenv.engine_front --port P --block-bytes B [--delay-s S]
        [--kv-dtype D --rope-config-hash H --attn-impl-id A]   (the engine's own identity)

Everything else comes from the pod's environment as the webhook injects it: POD_NAME,
POD_NAMESPACE and XDG_RUNTIME_DIR locate the sidecar's socket, KVTIER_WEIGHTS_VERSION
and KVTIER_KV_TRANSFER_CONFIG (model id, block size) name the key root; POD_IP (a
downward-API variable the test's pod spec adds) is the address served. `--delay-s`
makes every completion slow (a deadline test's engine).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

from kvtier import names, sidecar_config
from kvtier.identity import ModelIdentity
from kvtier.keys import KeyRoot
from kvtier_sidecar.client import EngineHit, SidecarClient
from kvtier_testenv import engine_io
from kvtier_testenv.synthetic import prefill_kv

COMPLETIONS = "/v1/completions"
HEALTH = "/health"
DEFAULT_TENANT = "default"  # the connector's for a request without cache_salt
MAX_BODY = 8 << 20


class ReferenceEngine:
    """The reference engine this front serves: its prefill runs through the pod's sidecar
    (`socket`) as the vLLM connector's would."""

    def __init__(self, identity: ModelIdentity, block_size: int, block_bytes: int, socket: str, served: str,
                 delay_s: float = 0.0) -> None:
        self.identity, self.block_size, self.block_bytes = identity, block_size, block_bytes
        self.socket, self.served, self.delay_s = socket, served, delay_s
        self.lock = threading.Lock()
        self.completions = 0
        self.wrong = 0  # hits whose bytes were not the prefill (answered 500, never used)

    def root(self, tenant: str) -> KeyRoot:
        return self.identity.root(tenant)

    def healthy(self) -> bool:
        try:
            SidecarClient(self.socket, timeout_s=2.0).close()
            return True
        except OSError:
            return False

    def complete(self, tokens: np.ndarray, tenant: str, warmup: bool = False) -> dict:
        """One prefill: the sidecar's hit loaded and reported, the rest computed and stored
        (a warm-up's: looked up as one, not reported, stored all the same)."""
        if self.delay_s:
            time.sleep(self.delay_s)
        root = self.root(tenant)
        client = SidecarClient(self.socket)
        try:
            hit, loaded = engine_io.request(client, root, tokens, self.block_bytes, warmup=warmup)
            matched = hit.matched_tokens if isinstance(hit, EngineHit) else 0
            client.release(hit)
            kv = prefill_kv(root, tokens, self.block_size, self.block_bytes)
            if loaded is not None and not np.array_equal(loaded, kv[: loaded.size]):
                # What an engine would compute with: never serve it.
                with self.lock:
                    self.wrong += 1
                raise WrongKV(f"the {matched} tokens loaded from kvtier differ from their prefill")
            whole = len(tokens) // self.block_size * self.block_size
            if whole > matched:
                client.store(root, tokens, kv)
        finally:
            client.close()
        with self.lock:
            self.completions += 1
        return {"id": f"cmpl-{uuid.uuid4().hex[:12]}", "object": "text_completion", "created": int(time.time()),
                "model": self.served, "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                "usage": {"prompt_tokens": int(len(tokens)), "completion_tokens": 1,
                          "total_tokens": int(len(tokens)) + 1, "cached_tokens": int(matched)},
                # Where the hit came from (kvtier's tier), for clients that count hits by tier.
                "kvtier": {"tier": hit.tier if isinstance(hit, EngineHit) else None}}


class WrongKV(Exception):
    """A hit whose bytes are not the prompt's prefill."""


def _handler(engine: ReferenceEngine) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: object) -> None:
            sys.stderr.write(f"engine_front: {fmt % args}\n")

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str) -> None:
            self._send(status, {"error": {"message": message, "type": "invalid_request_error", "code": status}})

        def do_GET(self) -> None:  # noqa: N802
            if self.path == HEALTH:
                self._send(200, {"ok": True}) if engine.healthy() else self._error(503, "sidecar not reachable")
            else:
                self._error(404, f"no route {self.path}")

        def do_POST(self) -> None:  # noqa: N802
            if self.path != COMPLETIONS:
                return self._error(404, f"no route {self.path}")
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= MAX_BODY:
                return self._error(400, "a JSON body is required")
            try:
                body = json.loads(self.rfile.read(length))
            except ValueError as exc:
                return self._error(400, f"body is not JSON: {exc}")
            if not isinstance(body, dict):
                return self._error(400, "body must be a JSON object")
            if body.get("model") != engine.served:
                return self._error(404, f"the model {body.get('model')!r} does not exist (serving {engine.served!r})")
            prompt = body.get("prompt")
            if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) and 0 <= t < 2**32 for t in prompt)):
                return self._error(400, "prompt must be a non-empty list of token ids")
            salt = body.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                return self._error(400, "cache_salt must be a string")
            warmup = names.is_warmup(body.get(names.KV_TRANSFER_PARAMS_FIELD))
            try:
                answer = engine.complete(np.asarray(prompt, dtype=np.uint32), salt or DEFAULT_TENANT, warmup)
            except (OSError, ValueError, WrongKV) as exc:
                return self._error(500, f"prefill failed: {exc}")
            self._send(200, answer)

    return Handler


def engine_from_env(env: dict[str, str], block_bytes: int, delay_s: float = 0.0,
                    served: str | None = None, own: dict[str, str] | None = None) -> ReferenceEngine:
    """`own`: the engine's own parts of its identity (kv_dtype, rope_config_hash,
    attn_impl_id), which a real engine knows from its model and the connector's config
    does not carry; unset ones keep ModelIdentity's defaults."""
    extra = json.loads(env.get(names.KV_TRANSFER_CONFIG_ENV) or "{}").get("kv_connector_extra_config") or {}
    identity = ModelIdentity(model_id=extra.get("model_id", ModelIdentity().model_id),
                             weights_version=env[names.WEIGHTS_VERSION_ENV],
                             **{k: v for k, v in (own or {}).items() if v})
    cfg = sidecar_config.from_mapping({}, env)
    socket = str(Path(env[names.RUNTIME_DIR_ENV]) / f"kvtier-{cfg.shm_name}.sock")
    return ReferenceEngine(identity, int(extra.get("block_size", 16)), block_bytes, socket,
                           served or identity.model_id, delay_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--block-bytes", type=int, required=True)
    ap.add_argument("--delay-s", type=float, default=0.0)
    ap.add_argument("--served-model-name", default=None)
    # The engine's own KV layout and attention (a real engine knows them from its model).
    ap.add_argument("--kv-dtype", default=None)
    ap.add_argument("--rope-config-hash", default=None)
    ap.add_argument("--attn-impl-id", default=None)
    args = ap.parse_args(argv)
    env = dict(os.environ)
    engine = engine_from_env(env, args.block_bytes, args.delay_s, args.served_model_name,
                             {"kv_dtype": args.kv_dtype, "rope_config_hash": args.rope_config_hash,
                              "attn_impl_id": args.attn_impl_id})
    server = ThreadingHTTPServer((env.get(names.POD_IP_ENV, "127.0.0.1"), args.port), _handler(engine))
    server.daemon_threads = True
    sys.stderr.write(f"engine_front: serving {engine.served} on {server.server_address}, sidecar {engine.socket}\n")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
