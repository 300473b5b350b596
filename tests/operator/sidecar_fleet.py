"""The operator's e2e fleet: pods whose REAL injected `kvtier-sidecar` is run by the
node agent on the pod's loopback IP. Tenants' prefixes are seeded through the real
engine client (`kvtier_sidecar.client`) over the pod's engine socket; warm-ups are
read back from each sidecar's own `GET /cache/jobs`."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier import sidecar_config
from kvtier.keys import KeyRoot
from kvtier_operator import names
from kvtier_sidecar.client import EngineHit, SidecarClient
from kvtier_testenv import engine_io
from kvtier_testenv.control_client import ControlEndpoint
from kvtier_testenv.synthetic import prefill_kv
from kvtier_testenv.nodeagent import NodeAgent

DIGEST = "sha256:" + "1" * 64
# The tiny model every e2e policy serves: 2 layers, 2 kv heads, head_dim 16, fp16.
TINY_SHAPE = {"layers": 2, "kvHeads": 2, "headDim": 16, "params": 1.0e6}
BLOCK_SIZE = 16
BLOCK_BYTES = 2 * 2 * 2 * 16 * 2 * BLOCK_SIZE
PROMPT_TOKENS = 72  # 4 full blocks are stored; a lookup of the prompt matches 64 tokens
MATCHED_TOKENS = 64
HTTP_TIMEOUT_S = 5.0


def pod_control(env: dict[str, str], port: int = 8081) -> ControlEndpoint:
    """The control endpoint of the injected sidecar whose environment is `env`: the CA
    and the server name from the policy's mounted control TLS Secret (its certificate's
    first name: `control_tls.server_name(namespace, policy)`)."""
    from cryptography import x509

    cert_file = env.get("KVTIER_CONTROL_TLS_CERT_FILE")
    if not cert_file:  # an operator told to inject plain HTTP
        return ControlEndpoint(env["POD_IP"], port)
    tls_dir = Path(cert_file).parent
    cert = x509.load_pem_x509_certificate(Path(cert_file).read_bytes())
    name = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName)[0]
    return ControlEndpoint(env["POD_IP"], port, name, (tls_dir / "ca.crt").read_bytes())


SLEEPING_ENGINE = {"name": "engine", "image": "engine:1", "command": ["sleep", "infinity"]}
"""An engine container the node agent does not run: shown running and ready, nothing listens."""


def stateful_set(app: str, replicas: int, container: dict = SLEEPING_ENGINE, version: str | None = None) -> dict:
    """A StatefulSet of `replicas` pods labelled app=`app`, started in parallel and gone at
    once; with `version`, its template carries that weights version and it rolls by
    partition (a rollout's workload)."""
    template: dict = {"metadata": {"labels": {"app": app}},
                      "spec": {"terminationGracePeriodSeconds": 0, "containers": [container]}}
    spec: dict = {"replicas": replicas, "serviceName": app, "podManagementPolicy": "Parallel",
                  "selector": {"matchLabels": {"app": app}}, "template": template}
    if version is not None:
        template["metadata"]["annotations"] = {names.WEIGHTS_VERSION_ANNOTATION: version}
        spec["updateStrategy"] = {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}}
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": app}, "spec": spec}


def tiny_policy(name: str, app: str, **spec: object) -> dict:
    body = {
        "apiVersion": "kvtier.io/v1alpha1", "kind": "KVCachePolicy", "metadata": {"name": name},
        "spec": {"selector": {"matchLabels": {"app": app}},
                 "model": {"id": "reference-tiny", "weightsVersion": DIGEST, "shape": TINY_SHAPE},
                 "hardware": {"denseTflopsPerGpu": 10}, "tiers": {"dram": {"capacity": "16Mi"}}},
    }
    body["spec"].update(spec)
    return body


def serving_pod(name: str, app: str) -> dict:
    """A pod the webhook injects the sidecar into (its engine container is not run)."""
    engine = {"name": "engine", "image": "engine:1", "command": ["sleep", "infinity"]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": app}},
            "spec": {"containers": [engine]}}


def root(tenant: str) -> KeyRoot:
    return KeyRoot(tenant, "reference-tiny", DIGEST, "fp16", "rope-default", "default")


def prompt(tenant: str, i: int) -> np.ndarray:
    seed = int.from_bytes(tenant.encode()[-4:].rjust(4, b"\0"), "little") * 7 + i
    return np.random.default_rng(seed).integers(0, 30_000, PROMPT_TOKENS).astype(np.uint32)


def kv_of(tenant: str, tokens: np.ndarray) -> np.ndarray:
    """The KV an engine would compute: a pure function of the chained block hashes."""
    return prefill_kv(root(tenant), tokens, BLOCK_SIZE, BLOCK_BYTES)


@dataclass
class PodSidecar:
    """One pod's real sidecar as a test reaches it: its control API as the operator
    calls it (HTTPS to the pod IP, the policy's certificate verified against the CA the
    pod's Secret carries), its engine socket on disk."""

    name: str
    ip: str
    socket: str
    control: ControlEndpoint

    @classmethod
    def of(cls, agent: NodeAgent, namespace: str, pod: str, container: str | None = None) -> "PodSidecar":
        """`container`: the sidecar's name, when the agent runs the pod's engine too."""
        env = agent.process(namespace, pod, container).env
        cfg = sidecar_config.from_mapping({}, env)
        return cls(pod, env["POD_IP"], str(Path(env["XDG_RUNTIME_DIR"]) / f"kvtier-{cfg.shm_name}.sock"),
                   pod_control(env))

    def get(self, path: str) -> dict:
        return self.control.get_json(path, timeout_s=HTTP_TIMEOUT_S)

    def warm_jobs(self) -> list[dict]:
        return [j for j in self.get("/cache/jobs").values() if j.get("kind") == "warm"]

    def seed(self, tenant: str, prompts: int) -> None:
        """Store the tenant's prompts here: two sightings each, as admission wants."""
        client = SidecarClient(self.socket)
        try:
            for i in range(prompts):
                tokens = prompt(tenant, i)
                for _ in range(2):
                    client.release(engine_io.request(client, root(tenant), tokens, BLOCK_BYTES)[0])
                    client.store(root(tenant), tokens, kv_of(tenant, tokens))
        finally:
            client.close()

    def offer_only(self, tenant: str, prompts: int, rounds: int) -> None:
        """Look the tenant's prompts up `rounds` times and load nothing (an engine whose
        own prefix cache held them): the sidecar offers hits the engine never takes."""
        client = SidecarClient(self.socket)
        try:
            for _ in range(rounds):
                for i in range(prompts):
                    client.release(engine_io.request(client, root(tenant), prompt(tenant, i), BLOCK_BYTES,
                                                     load=False)[0])
        finally:
            client.close()

    def holds(self, tenant: str, prompts: int) -> bool:
        """Every prompt of the tenant hits here with the KV a recompute gives."""
        client = SidecarClient(self.socket)
        try:
            for i in range(prompts):
                tokens = prompt(tenant, i)
                hit, dst = engine_io.request(client, root(tenant), tokens, BLOCK_BYTES)
                try:
                    if not isinstance(hit, EngineHit) or hit.matched_tokens != MATCHED_TOKENS:
                        return False
                    if not np.array_equal(dst, kv_of(tenant, tokens)[: len(dst)]):
                        raise AssertionError(f"wrong KV for {tenant} prompt {i} on {self.name}")
                finally:
                    client.release(hit)
            return True
        finally:
            client.close()
