"""The operator's Kubernetes I/O beyond what kopf does for it: ConfigMaps, the
policy's status and annotations. The official client is synchronous, so each call runs
in a worker thread; every function here is one request (or a read-then-write)."""
from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Any

import kubernetes
from kubernetes.client.rest import ApiException

from kvtier import policy

log = logging.getLogger("kvtier.operator.kube")


@dataclass(slots=True)
class Kube:
    """Clients created once in `on.startup`, kept in kopf's memo."""

    core: kubernetes.client.CoreV1Api
    custom: kubernetes.client.CustomObjectsApi
    apps: kubernetes.client.AppsV1Api | None = None  # the rollout's workload

    @classmethod
    def from_environment(cls) -> "Kube":
        """In-cluster credentials, else $KUBECONFIG read now (the client library reads
        it once at import), without touching the library's global default config."""
        try:
            kubernetes.config.load_incluster_config()
            api = kubernetes.client.ApiClient()
        except kubernetes.config.ConfigException:
            api = kubernetes.config.new_client_from_config(config_file=os.environ.get("KUBECONFIG"))
        return cls(kubernetes.client.CoreV1Api(api), kubernetes.client.CustomObjectsApi(api),
                   kubernetes.client.AppsV1Api(api))

    def close(self) -> None:
        self.core.api_client.close()

    async def server_version(self) -> tuple[str, str]:
        """The API server's (major, minor) from /version."""
        info = await asyncio.to_thread(kubernetes.client.VersionApi(self.core.api_client).get_code)
        return info.major, info.minor

    # --- ConfigMaps ---------------------------------------------------------------

    async def read_config_map(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            cm = await asyncio.to_thread(self.core.read_namespaced_config_map, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return self.core.api_client.sanitize_for_serialization(cm)

    async def apply_config_map(self, body: dict[str, Any]) -> bool:
        """Create the ConfigMap, or patch it if its data or annotations differ.
        Returns True when something was written."""
        meta = body["metadata"]
        current = await self.read_config_map(meta["namespace"], meta["name"])
        if current is None:
            await asyncio.to_thread(self.core.create_namespaced_config_map, meta["namespace"], body)
            return True
        same_data = (current.get("data") or {}) == body.get("data", {})
        cur_ann = (current.get("metadata") or {}).get("annotations") or {}
        same_ann = all(cur_ann.get(k) == v for k, v in (meta.get("annotations") or {}).items())
        if same_data and same_ann:
            return False
        patch = {"metadata": {"annotations": meta.get("annotations", {}), "labels": meta.get("labels", {})},
                 "data": body.get("data", {})}
        await asyncio.to_thread(self.core.patch_namespaced_config_map, meta["name"], meta["namespace"], patch)
        return True

    # --- tokens for the sidecars (TokenRequest on this operator's own ServiceAccount) --

    async def request_token(self, namespace: str, service_account: str, audience: str, ttl_s: int) -> str:
        """A token of `namespace/service_account` for `audience`, valid `ttl_s` seconds."""
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"audiences": [audience], "expirationSeconds": ttl_s}}
        answer = await asyncio.to_thread(self.core.create_namespaced_service_account_token,
                                         service_account, namespace, body)
        return answer.status.token

    # --- Secrets (only those the chart grants by name: redis.secretRef) -------------

    async def read_secret_key(self, namespace: str, name: str, key: str) -> str | None:
        """One key of a Secret, decoded; None when the Secret or the key is missing or
        this operator may not read it (the chart grants `get` per named Secret only)."""
        import base64

        try:
            secret = await asyncio.to_thread(self.core.read_namespaced_secret, name, namespace)
        except ApiException as exc:
            if exc.status in (403, 404):
                log.warning("cannot read Secret %s/%s: %s", namespace, name, exc.reason)
                return None
            raise
        raw = (secret.data or {}).get(key)
        return base64.b64decode(raw).decode() if raw else None

    async def create_secret_if_absent(self, body: dict[str, Any]) -> bool:
        """Create the Secret unless one of that name exists (never reads or changes an
        existing one: the operator holds `create` on Secrets, not `get` or `patch`).
        True when it was created."""
        meta = body["metadata"]
        try:
            await asyncio.to_thread(self.core.create_namespaced_secret, meta["namespace"], body)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    async def read_secret_data(self, namespace: str, name: str) -> dict[str, bytes] | None:
        """A Secret's data, decoded; None when it does not exist. The chart grants `get`
        on one Secret only: the operator's own control CA, by name."""
        import base64

        try:
            secret = await asyncio.to_thread(self.core.read_namespaced_secret, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}

    async def replace_secret(self, body: dict[str, Any]) -> None:
        """Write the Secret whole: create it, or replace an existing one of that name
        (`update`, whose answer holds what was written and nothing of the old data: the
        operator never reads the Secrets it issues certificates into)."""
        meta = body["metadata"]
        try:
            await asyncio.to_thread(self.core.create_namespaced_secret, meta["namespace"], body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            await asyncio.to_thread(self.core.replace_namespaced_secret, meta["name"], meta["namespace"], body)

    # --- NetworkPolicies -----------------------------------------------------------

    async def apply_network_policy(self, body: dict[str, Any]) -> None:
        """Create the NetworkPolicy, or replace its spec when it already exists."""
        net = kubernetes.client.NetworkingV1Api(self.core.api_client)
        meta = body["metadata"]
        try:
            await asyncio.to_thread(net.create_namespaced_network_policy, meta["namespace"], body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            patch = {"metadata": {"labels": meta.get("labels", {})}, "spec": body["spec"]}
            await asyncio.to_thread(net.patch_namespaced_network_policy, meta["name"], meta["namespace"], patch)

    async def delete_config_map(self, namespace: str, name: str) -> None:
        try:
            await asyncio.to_thread(self.core.delete_namespaced_config_map, name, namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise

    # --- the policy -----------------------------------------------------------------

    async def read_policy(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await asyncio.to_thread(
                self.custom.get_namespaced_custom_object,
                policy.GROUP, policy.VERSION, namespace, policy.PLURAL, name,
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def list_policies(self, namespace: str, timeout_s: float) -> list[dict[str, Any]]:
        """The namespace's policies straight from the apiserver (the webhook's answer
        while the operator's own index is still loading)."""
        listed = await asyncio.to_thread(
            self.custom.list_namespaced_custom_object, policy.GROUP, policy.VERSION, namespace, policy.PLURAL,
            _request_timeout=timeout_s,
        )
        return list(listed.get("items") or [])

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        await asyncio.to_thread(
            self.custom.patch_namespaced_custom_object_status,
            policy.GROUP, policy.VERSION, namespace, policy.PLURAL, name, {"status": status},
        )

    async def patch_annotations(self, namespace: str, name: str, annotations: dict[str, str | None]) -> None:
        await asyncio.to_thread(
            self.custom.patch_namespaced_custom_object,
            policy.GROUP, policy.VERSION, namespace, policy.PLURAL, name,
            {"metadata": {"annotations": annotations}},
        )

    # --- the rollout's workload and its pods --------------------------------------------

    async def read_stateful_set(self, namespace: str, name: str) -> dict[str, Any] | None:
        assert self.apps is not None
        try:
            sts = await asyncio.to_thread(self.apps.read_namespaced_stateful_set, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return self.core.api_client.sanitize_for_serialization(sts)

    async def patch_stateful_set(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        assert self.apps is not None
        await asyncio.to_thread(self.apps.patch_namespaced_stateful_set, name, namespace, patch)

    async def create_event_once(self, body: dict[str, Any]) -> bool:
        """Create a core/v1 Event under its own (deterministic) name; False when an
        Event of that name exists already (the same happening, posted before a crash)."""
        try:
            await asyncio.to_thread(self.core.create_namespaced_event, body["metadata"]["namespace"], body)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    async def node_allocatable_memory(self, name: str) -> int | None:
        """A node's allocatable memory in bytes; None when the node or the figure is missing."""
        try:
            node = await asyncio.to_thread(self.core.read_node, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        memory = ((node.status.allocatable if node.status else None) or {}).get("memory")
        try:
            return policy.parse_quantity_bytes(memory) if memory else None
        except ValueError:
            return None

    async def nodes_allocatable_memory(self, label_selector: str) -> dict[str, int]:
        """Allocatable memory in bytes of the nodes `label_selector` matches (a pod's
        nodeSelector; empty: every node), by node name; nodes without the figure are left out."""
        # resourceVersion "0": served from the apiserver's cache, never etcd; this
        # advisory check repeats on every membership pass while a pod is unscheduled.
        listed = await asyncio.to_thread(self.core.list_node, label_selector=label_selector, resource_version="0")
        out = {}
        for node in listed.items:
            memory = ((node.status.allocatable if node.status else None) or {}).get("memory")
            try:
                if memory:
                    out[node.metadata.name] = policy.parse_quantity_bytes(memory)
            except ValueError:
                continue
        return out

    async def read_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        assert self.apps is not None
        try:
            dep = await asyncio.to_thread(self.apps.read_namespaced_deployment, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return self.core.api_client.sanitize_for_serialization(dep)

    async def patch_deployment(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        assert self.apps is not None
        await asyncio.to_thread(self.apps.patch_namespaced_deployment, name, namespace, patch)

    async def create_deployment(self, namespace: str, body: dict[str, Any]) -> None:
        """Create; an existing one (a restarted operator's second try) is left as is."""
        assert self.apps is not None
        try:
            await asyncio.to_thread(self.apps.create_namespaced_deployment, namespace, body)
        except ApiException as exc:
            if exc.status != 409:
                raise

    async def delete_deployment(self, namespace: str, name: str) -> None:
        assert self.apps is not None
        try:
            await asyncio.to_thread(self.apps.delete_namespaced_deployment, name, namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise

    async def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        pods = await asyncio.to_thread(self.core.list_namespaced_pod, namespace, label_selector=label_selector)
        return self.core.api_client.sanitize_for_serialization(pods).get("items") or []

    async def patch_pod_condition(self, namespace: str, name: str, uid: str, condition: dict[str, Any]) -> bool:
        """Set one condition of a pod's status (pods/status, strategic merge: the
        conditions merge by type, so kubelet's own stay). `uid` guards against a pod
        recreated under the same name. False when the pod is gone or was replaced."""
        body = {"metadata": {"uid": uid}, "status": {"conditions": [condition]}}
        try:
            await asyncio.to_thread(self.core.patch_namespaced_pod_status, name, namespace, body,
                                    _content_type="application/strategic-merge-patch+json")
        except ApiException as exc:
            if exc.status in (404, 409, 422):
                return False
            raise
        return True
