"""The key root's pydantic forms: `WireRoot`, a root as it crosses a process boundary
(bounded, strict), and `ModelIdentity`, the root minus the tenant. `KeyRoot` itself is in
`kvtier.keys` (compiled, where pydantic models cannot live); `KeyRoot.to_wire` and
`KeyRoot.from_wire` go through `WireRoot`."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from kvtier.dtypes import DEFAULT_KV_DTYPE
from kvtier.keys import KEY_ROOT_FIELDS, KeyRoot
from kvtier.tenants import TenantName


class WireRoot(BaseModel):
    """A key root on a wire (the engine socket, the peer protocol): `KeyRoot`'s fields,
    bounded so a hostile peer cannot make a root (a metric label, a log field) of any size."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant: TenantName
    model_id: str = Field(min_length=1, max_length=256)
    weights_version: str = Field(min_length=1, max_length=256)
    kv_dtype: str = Field(min_length=1, max_length=64)
    rope_config_hash: str = Field(min_length=1, max_length=256)
    attn_impl_id: str = Field(min_length=1, max_length=256)

    @classmethod
    def of(cls, root: KeyRoot) -> "WireRoot":
        return cls(**root.to_wire())

    def key_root(self) -> KeyRoot:
        return KeyRoot(**self.model_dump())


DEFAULT_MODEL_ID = "reference-tiny"
DEFAULT_WEIGHTS_VERSION = "dev"
DEFAULT_ROPE_CONFIG_HASH = "rope-default"
DEFAULT_ATTN_IMPL_ID = "default"


class ModelIdentity(BaseModel):
    """Everything in a key root but the tenant: one served model, fixed for an engine's
    lifetime. The connector's engine identity and the sidecar's served model are this;
    a policy's `model` section yields it (`policy.ModelSpec.identity`)."""

    model_config = ConfigDict(frozen=True)

    model_id: str = DEFAULT_MODEL_ID
    weights_version: str = DEFAULT_WEIGHTS_VERSION
    kv_dtype: str = DEFAULT_KV_DTYPE.value
    rope_config_hash: str = DEFAULT_ROPE_CONFIG_HASH
    attn_impl_id: str = DEFAULT_ATTN_IMPL_ID

    def identity(self) -> "ModelIdentity":
        """Just the identity (a subclass's other fields dropped)."""
        return ModelIdentity(**{name: getattr(self, name) for name in KEY_ROOT_FIELDS[1:]})

    def root(self, tenant: str) -> KeyRoot:
        return KeyRoot(tenant, *(getattr(self, name) for name in KEY_ROOT_FIELDS[1:]))
