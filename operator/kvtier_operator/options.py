"""The operator's own settings (not a policy's): one pydantic-settings model,
`OperatorOptions`, that yields the defaults, the command line of `kvtier-operator`
(`add_flags`, `from_args`, `to_argv`) and the environment the kopf handlers read
(`to_env`, `from_env`), so `kopf run` and tests see the same.

Each field is one setting: its flag is `--<field-name>` in kebab case unless its `Flag`
names another (`--sidecar-plain-http` sets `sidecar_tls` False), its help the field's
description; its env name `KVTIER_OPERATOR_<FIELD_NAME>`. A bool's flag takes no value
and sets the opposite of the default; a list's flag is given once per item (the env
joins them with commas); the pod labels are `k=v,k=v` on both."""
from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args, get_origin

from pydantic import Field, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

if TYPE_CHECKING:
    from kvtier_operator.netpol import SidecarAccess

ENV_PREFIX = "KVTIER_OPERATOR_"
# Watches are re-established at least this often, so a silently dropped connection
# (a load balancer's idle timeout) cannot starve the operator of events.
WATCH_SERVER_TIMEOUT_S = 120
WATCH_CLIENT_TIMEOUT_S = 150
WATCH_CONNECT_TIMEOUT_S = 10
# A membership loop re-checks even without a pod event: level-based safety net.
RESYNC_INTERVAL_S = 60.0
# Pod events arriving this close together are planned as one epoch.
DEBOUNCE_S = 0.3
# Warm-ups in flight per target sidecar: a new home keeps most of its peer link and
# CPU for live traffic while it is being warmed.
WARMS_PER_TARGET = 2
# A rollout step's new pods: their hit rate over their first minute of traffic goes
# into the rollout history (kvtier_operator.first_minute; tests shorten it).
FIRST_MINUTE_S = 60.0
DEFAULT_SIDECAR_IMAGE = "ghcr.io/kvtier/kvtier:0.1.0"
# The operator's CA Secret (and its public twin, a ConfigMap) in the operator's namespace.
DEFAULT_CONTROL_CA_SECRET = "kvtier-control-ca"
# The label the chart gives the operator's pods (charts/kvtier, kvtier.selectorLabels).
DEFAULT_OPERATOR_POD_LABELS = "app.kubernetes.io/name=kvtier-operator"


@dataclass(frozen=True, slots=True)
class Flag:
    """A setting's flag when it is not `--<field-name>`: `name` without the dashes,
    `metavar` as argparse shows it."""

    name: str | None = None
    metavar: str | None = None


def _split(value: Any) -> Any:
    """A comma-joined string (the env's form, or a caller's) as its items."""
    return [v for v in (s.strip() for s in value.split(",")) if v] if isinstance(value, str) else value


def _labels(value: Any) -> Any:
    """`k=v,k=v` as a mapping; entries without `=` are ignored."""
    if isinstance(value, str):
        return dict(kv.split("=", 1) for kv in _split(value) if "=" in kv)
    return value


Users = Annotated[list[str], NoDecode]
Labels = Annotated[dict[str, str], NoDecode]


class OperatorOptions(BaseSettings):
    """Constructing one reads nothing but its arguments (the defaults fill the rest);
    `from_env` reads the environment, `from_args` a parsed command line."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_ignore_empty=True, frozen=True, extra="forbid")

    sidecar_image: str = Field(DEFAULT_SIDECAR_IMAGE, description="image of the injected sidecar")
    sidecar_image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = Field(
        "IfNotPresent", description="imagePullPolicy of the injected sidecar (Never: nodes hold the image already)")
    native_sidecars: Literal["auto", "never"] = Field(
        "never", description="auto: inject a native sidecar (init container, restartPolicy Always) where the "
                             "API server is >= 1.29; never: a plain container")
    webhook_host: str | None = Field(
        None, description="address the webhook listens on and the apiserver reaches it by (none: no webhook "
                          "server, injection off)")
    webhook_port: int = Field(9443, description="port of the webhook server")
    webhook_cert: str | None = Field(None, description="PEM serving certificate (e.g. mounted from a Secret)")
    webhook_key: str | None = Field(None, description="PEM private key of --webhook-cert")
    resync_interval_s: float = Field(RESYNC_INTERVAL_S,
                                     description="a membership loop re-checks this often without a pod event")
    debounce_s: float = Field(DEBOUNCE_S, description="pod events this close together are planned as one epoch")
    warms_per_target: int = Field(WARMS_PER_TARGET, description="warm-ups in flight per new home when tenants move")
    first_minute_s: float = Field(FIRST_MINUTE_S, gt=0, description="a rollout measures each new pod's hit rate "
                                                                    "over this long from its first traffic")
    metrics_host: str = Field("0.0.0.0", description="address the metrics server listens on (e.g. the pod IP)")
    metrics_port: int = Field(0, description="serve the rollout metrics on this port (0: off)")
    sidecar_auth: Literal["tokenreview", "open"] = Field(
        "tokenreview", description="the injected sidecars' control API: TokenReview-checked (default) or open "
                                   "(loopback tests only)")
    sidecar_auth_users: Annotated[Users, Flag("sidecar-auth-user", "IDENTITY")] = Field(
        default_factory=list, description="identity the sidecars accept (repeatable), normally this operator's "
                                          "own ServiceAccount: system:serviceaccount:NS:NAME")
    sidecar_protect_metrics: bool = Field(False, description="the sidecars' /metrics needs the operator's token too")
    sidecar_metrics_users: Annotated[Users, Flag("sidecar-metrics-user", "IDENTITY")] = Field(
        default_factory=list, description="identity allowed the sidecars' protected /metrics only (repeatable)")
    sidecar_token_file: str | None = Field(
        None, description="this operator's projected ServiceAccount token for the sidecars' shared audience "
                          "(re-read as kubelet rotates it)")
    sidecar_token_service_account: Annotated[str, Flag(metavar="NAMESPACE/NAME")] = Field(
        "", description="this operator's ServiceAccount: mint a short-lived token per sidecar for that pod's "
                        "own audience (`control_api.pod_audience`; preferred to --sidecar-token-file)")
    sidecar_tls: Annotated[bool, Flag("sidecar-plain-http")] = Field(
        True, description="sidecars serve their control API without TLS and get no token (a loopback lab only; "
                          "default: HTTPS with certificates from this operator's CA)")
    control_ca_secret: Annotated[str, Flag(metavar="NAME")] = Field(
        DEFAULT_CONTROL_CA_SECRET, description="the Secret in --operator-namespace holding the control CA (made "
                                               "when absent)")
    network_policies: bool = Field(False, description="write a NetworkPolicy per KVCachePolicy guarding the "
                                                      "sidecars' ports")
    operator_namespace: str = Field("", description="this operator's namespace (its control CA Secret; the "
                                                    "NetworkPolicy peer)")
    operator_pod_labels: Labels = Field(
        default_factory=lambda: _labels(DEFAULT_OPERATOR_POD_LABELS),
        description="k=v,k=v labels of this operator's pods, allowed to the sidecars' HTTP port (the chart's "
                    "selector label by default)")
    monitoring_namespace: str = Field("", description="namespace allowed to scrape sidecar metrics (empty: none)")
    serving_ports_open: Annotated[bool, Flag("close-serving-ports")] = Field(
        True, description="the per-policy NetworkPolicy leaves the pods' other ports to other policies")

    @field_validator("sidecar_auth_users", "sidecar_metrics_users", mode="before")
    @classmethod
    def _comma_joined(cls, value: Any) -> Any:
        return _split(value)

    @field_validator("operator_pod_labels", mode="before")
    @classmethod
    def _label_pairs(cls, value: Any) -> Any:
        return _labels(value)

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)  # the environment only through from_env and from_args

    def sidecar_access(self) -> "SidecarAccess | None":
        """What the per-policy NetworkPolicy allows; None when they are off."""
        from kvtier_operator.netpol import SidecarAccess

        if not self.network_policies:
            return None
        return SidecarAccess(self.operator_namespace, dict(self.operator_pod_labels), self.monitoring_namespace or None,
                             self.serving_ports_open)

    # -- the environment ------------------------------------------------------------------

    @classmethod
    def env_name(cls, field: str) -> str:
        return ENV_PREFIX + field.upper()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "OperatorOptions":
        """The settings in `env` (os.environ when None); an empty value is the default."""
        return cls(**_EnvOf(cls, os.environ if env is None else env)())

    def to_env(self) -> dict[str, str]:
        """The env `from_env` reads back as these settings; None and empty values are
        left out (read back as the default)."""
        out = {}
        for name in type(self).model_fields:
            text = _text(getattr(self, name))
            if text:
                out[self.env_name(name)] = text
        return out

    # -- the command line -----------------------------------------------------------------

    @classmethod
    def flag_name(cls, field: str) -> str:
        flag = _flag(cls.model_fields[field])
        return "--" + (flag.name if flag.name else field.replace("_", "-"))

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field. Each stores under the field's name and only when given
        (argparse.SUPPRESS): `from_args` tells a flag given from a default."""
        for name, info in cls.model_fields.items():
            flag, default = _flag(info), info.get_default(call_default_factory=True)
            kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": info.description}
            if info.annotation is bool:
                kwargs.update(action="store_const", const=not default)
            elif get_origin(info.annotation) is list:
                kwargs.update(action="append", metavar=flag.metavar)
            else:
                choices = get_args(info.annotation) if get_origin(info.annotation) is Literal else None
                kwargs.update(type=_scalar(info.annotation), choices=choices, metavar=flag.metavar)
                if default not in (None, "", {}):
                    kwargs["help"] += f" (default: {_text(default)})"
            parser.add_argument(cls.flag_name(name), **kwargs)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **override: Any) -> "OperatorOptions":
        """The settings a command line parsed with `add_flags` gave; for the rest, the
        process's env (`KVTIER_OPERATOR_<FIELD>`, e.g. the chart's operator.extraEnv),
        else the defaults. `override`: fields a caller derived from other flags."""
        given = {name: getattr(args, name) for name in cls.model_fields if hasattr(args, name)}
        return cls(**{**_EnvOf(cls, os.environ)(), **given, **override})

    def to_argv(self) -> list[str]:
        """Flags that `from_args` reads back as these settings (defaults left out)."""
        argv = []
        for name, info in type(self).model_fields.items():
            value, default = getattr(self, name), info.get_default(call_default_factory=True)
            if value == default:
                continue
            flag = self.flag_name(name)
            if info.annotation is bool:
                argv.append(flag)
            elif isinstance(value, list):
                argv += [f"{flag}={item}" for item in value]
            elif value is not None:
                argv.append(f"{flag}={_text(value)}")
        return argv


def _flag(info: FieldInfo) -> Flag:
    return next((m for m in info.metadata if isinstance(m, Flag)), Flag())


def _scalar(annotation: Any) -> Any:
    """The argparse `type` of a scalar field: str for strings, literals and optionals."""
    return annotation if annotation in (int, float) else str


def _text(value: Any) -> str:
    """A value as the env and the flags write it."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(value)
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    return "" if value is None else str(value)


class _EnvOf(EnvSettingsSource):
    """pydantic-settings' env source over a given mapping rather than os.environ."""

    def __init__(self, settings_cls: type[BaseSettings], env: Mapping[str, str]) -> None:
        self._given = dict(env)
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        env = self._given if self.case_sensitive else {k.lower(): v for k, v in self._given.items()}
        return {k: v for k, v in env.items() if not (self.env_ignore_empty and v == "")}
