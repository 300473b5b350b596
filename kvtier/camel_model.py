"""The base of every model stored in Kubernetes: camelCase field names, strict keys,
and cross-field rules stated once — as CEL the apiserver enforces (emitted into the
CRD schema by `kvtier crd`) and as Python the operator enforces on parse."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic.alias_generators import to_camel


@dataclass(frozen=True, slots=True)
class CelRule:
    """A cross-field rule, stated once: CEL for the apiserver, Python for the operator.

    `holds` receives the validated model and must agree with `cel` on every input the
    schema admits; tests apply the invalid examples to the real apiserver and to the
    models and check both reject them with `message`.
    """

    cel: str
    message: str
    holds: Callable[[Any], bool]
    # The operator's message may add the object's numbers to `message` (`describe`).
    describe: Callable[[Any], str] | None = None

    def schema(self) -> dict[str, str]:
        return {"rule": self.cel, "message": self.message}

    def explain(self, model: Any) -> str:
        return self.describe(model) if self.describe is not None else self.message


class CamelModel(BaseModel):
    """Base for every part of the resource: camelCase keys in JSON, strict keys, and
    `CEL_RULES` both emitted into the schema and enforced on parse."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        json_schema_extra=lambda schema, cls: _emit_rules(schema, cls),
    )
    CEL_RULES: ClassVar[tuple[CelRule, ...]] = ()

    @model_validator(mode="after")
    def _cel_rules_hold(self) -> "CamelModel":
        for rule in self.CEL_RULES:
            if not rule.holds(self):
                raise ValueError(rule.explain(self))
        return self

    def k8s_json(self) -> dict[str, Any]:
        """The camelCase JSON form, as stored in Kubernetes."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


def _emit_rules(schema: dict[str, Any], cls: type) -> None:
    rules = [rule.schema() for rule in cls.__dict__.get("CEL_RULES", ())]
    if rules:
        schema["x-kubernetes-validations"] = rules


