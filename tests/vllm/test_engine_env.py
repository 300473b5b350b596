"""The webhook hands the serving container a --kv-transfer-config rendered from the
policy, and the connector reading it finds the very socket the sidecar listens on."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from kvtier import policy
from kvtier_operator import injection, names, sidecar_render
from kvtier_operator.engine_env import KV_TRANSFER_CONFIG_ENV
from kvtier_vllm.config import parse_config

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"

IMAGE = injection.SidecarImage(image="kvtier:test")


def _spec() -> policy.KVCachePolicySpec:
    return policy.parse_policy(yaml.safe_load((EXAMPLES_DIR / "llama-70b-interactive.yaml").read_text())).spec


def _injected_engine(containers=None) -> dict:
    pod = {"metadata": {"name": "chat-0", "namespace": "serving", "labels": {"app.kubernetes.io/name": "llama-70b-chat"}},
           "spec": {"containers": containers or [{"name": "engine", "image": "vllm/vllm-openai"}]}}
    patch = injection.inject(pod, "chat", _spec(), IMAGE)
    return {c["name"]: c for c in patch["spec"]["containers"]}["engine"]


def _resolve(env: list[dict], pod_name: str, namespace: str) -> dict[str, str]:
    """What the kubelet would put in the container's environment."""
    fields = {"metadata.name": pod_name, "metadata.namespace": namespace,
              f"metadata.annotations['{names.WEIGHTS_VERSION_ANNOTATION}']": "sha256:" + "ab" * 32}
    return {e["name"]: e["value"] if "value" in e else fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
            for e in env}


def test_serving_container_gets_a_kv_transfer_config_rendered_from_the_policy():
    spec = _spec()
    env = _resolve(_injected_engine()["env"], "chat-0", "serving")
    ktc = json.loads(env[KV_TRANSFER_CONFIG_ENV])
    assert ktc["kv_connector"] == "KvtierConnector" and ktc["kv_connector_module_path"] == "kvtier_vllm.connector"
    assert ktc["kv_load_failure_policy"] == "recompute"
    cfg = parse_config(ktc["kv_connector_extra_config"], env=env)
    assert cfg.model_id == spec.model.id and cfg.block_size == spec.block_size
    assert cfg.weights_version == "sha256:" + "ab" * 32
    sidecar = sidecar_render.sidecar_config(spec).model_copy(update={"pod_name": "chat-0", "pod_namespace": "serving"})
    sidecar_env = {"XDG_RUNTIME_DIR": names.RUN_MOUNT_PATH}  # the sidecar container's own env
    assert cfg.socket == sidecar.engine_socket_path(sidecar_env)
    assert cfg.socket.startswith(names.RUN_MOUNT_PATH + "/")  # inside the volume both containers mount


def test_a_container_keeps_the_engine_env_it_sets_itself():
    own = [{"name": KV_TRANSFER_CONFIG_ENV, "value": "{}"}, {"name": "XDG_RUNTIME_DIR", "value": "/run/x"}]
    engine = _injected_engine([{"name": "engine", "image": "e", "env": own}])
    env = {e["name"]: e for e in engine["env"]}
    assert env[KV_TRANSFER_CONFIG_ENV]["value"] == "{}" and env["XDG_RUNTIME_DIR"]["value"] == "/run/x"
    assert [e["name"] for e in engine["env"]].count("XDG_RUNTIME_DIR") == 1
