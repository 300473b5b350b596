"""The per-policy sidecar configuration: `KVCachePolicySpec` -> `SidecarConfig` ->
ConfigMap. Pure; the handler writes the result only when its digest changed."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kvtier import policy
from kvtier.sidecar_config import NvmeConfig, ServedModel, SidecarConfig, dump_yaml

from kvtier_operator import names
from kvtier_operator.economics import resolved_shape


# The rendered config may use half of a ConfigMap's 1 MiB: the rest is margin for the
# ConfigMap's own metadata and for fields added later. The CRD bounds keep every policy
# it accepts far below this; a render above it is reported, never written.
MAX_CONFIG_BYTES = 512 << 10


class ConfigTooLarge(ValueError):
    """A rendered sidecar config that would not fit its ConfigMap with margin."""


@dataclass(frozen=True, slots=True)
class RenderedConfig:
    text: str
    digest: str  # sha256 of `text`, recorded in status and on the ConfigMap


def sidecar_config(spec: policy.KVCachePolicySpec) -> SidecarConfig:
    """The sidecar's view of a policy. Pod identity (name, IP) comes from the downward
    API at run time; a `redis.secretRef` is injected as KVTIER_REDIS_URL, not written here."""
    shape = resolved_shape(spec.model)
    dtype_bytes = spec.model.dtype_bytes
    nvme = spec.tiers.nvme
    return SidecarConfig(
        model=ServedModel(
            **spec.model.identity().model_dump(),
            layers=shape.layers,
            kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            dtype_bytes=dtype_bytes,
            kv_elements_per_token=shape.kv_elements_per_token,
        ),
        block_size=spec.block_size,
        dram_capacity_bytes=policy.parse_quantity_bytes(spec.tiers.dram.capacity),
        min_sightings=spec.admission.min_sightings,
        thrash_ratio=spec.admission.thrash_ratio,
        peer_enabled=spec.tiers.peer.enabled,
        nvme=NvmeConfig(mode=nvme.mode, path=nvme.path),
        redis_url=spec.redis.url if spec.redis else None,
        redis_cluster=bool(spec.redis and spec.redis.cluster),
        platform_prefixes=[p.token_ids for p in spec.shared_prefixes],
    )


class BrokenPolicy(ValueError):
    """A stored policy the operator cannot carry out: its spec does not parse (stored
    before a rule that now refuses it) or its sidecar config would be invalid. The
    message says what to fix; its pods are admitted without the sidecar. `reason` is
    the condition reason: SpecInvalid or SidecarConfigInvalid."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def errors_text(exc: ValidationError) -> str:
    """A pydantic error as one line: `field.path: what is wrong; ...`."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'spec'}: {e['msg']}" for e in exc.errors(include_url=False))


def carried_out(raw_spec: Any) -> policy.KVCachePolicySpec:
    """The spec parsed, and checked to render a valid sidecar config; BrokenPolicy when not."""
    try:
        spec = policy.KVCachePolicySpec.model_validate(raw_spec)
    except ValidationError as exc:
        raise BrokenPolicy("SpecInvalid", f"the policy's spec is invalid: {errors_text(exc)}") from None
    try:
        sidecar_config(spec)
    except ValidationError as exc:
        raise BrokenPolicy("SidecarConfigInvalid",
                           f"the sidecar config would be invalid: {errors_text(exc)}") from None
    return spec


def render(spec: policy.KVCachePolicySpec) -> RenderedConfig:
    """The config text and its digest; ConfigTooLarge (saying by how much) past MAX_CONFIG_BYTES."""
    text = dump_yaml(sidecar_config(spec))
    size = len(text.encode())
    if size > MAX_CONFIG_BYTES:
        shared = sum(len(p.token_ids) for p in spec.shared_prefixes)
        raise ConfigTooLarge(f"the sidecar config renders to {size} bytes, over the {MAX_CONFIG_BYTES}-byte budget "
                             f"(sharedPrefixes hold {shared} token ids); shorten sharedPrefixes")
    return RenderedConfig(text, hashlib.sha256(text.encode()).hexdigest()[:16])


def config_map(name: str, namespace: str, rendered: RenderedConfig) -> dict[str, Any]:
    """The ConfigMap body (owner reference added by the handler)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": names.sidecar_config_map(name),
            "namespace": namespace,
            "labels": {names.POLICY_LABEL: name, names.COMPONENT_LABEL: "sidecar-config"},
            "annotations": {f"{names.PREFIX}/config-digest": rendered.digest},
        },
        "data": {names.CONFIG_KEY: rendered.text},
    }
