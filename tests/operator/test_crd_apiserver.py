"""The generated CRD on the real apiserver: it is accepted, every example is accepted,
every invalid policy is rejected by the schema or a CEL rule with the expected
message, and the apiserver's defaults are the models' defaults."""
from __future__ import annotations

import pytest
import yaml

from kvtier import policy
from kvtier_testenv.kubectl import KubectlError
from operator_cases import example_paths, invalid_cases


def test_crd_is_established_with_short_name_and_columns(kvcp_crd, kubectl):
    crd = kubectl.get_json("crd", kvcp_crd)
    assert crd["spec"]["names"]["shortNames"] == ["kvcp"]
    assert any(c["type"] == "Established" and c["status"] == "True" for c in crd["status"]["conditions"])
    assert kubectl.run("get", "kvcp").returncode == 0


@pytest.mark.parametrize("path", example_paths(), ids=lambda p: p.stem)
def test_every_example_is_accepted(kvcp_crd, kubectl, path):
    kubectl.apply(path)
    name = yaml.safe_load(path.read_text())["metadata"]["name"]
    stored = kubectl.get_json("kvcp", name)
    policy.parse_policy(stored)  # what the apiserver stores, the operator can read


@pytest.mark.parametrize("case", invalid_cases(), ids=lambda c: c.path.stem)
def test_every_invalid_policy_is_rejected_with_its_message(kvcp_crd, kubectl, case):
    with pytest.raises(KubectlError) as err:
        kubectl.apply(case.path)
    assert case.expect in err.value.stderr, err.value.stderr
    assert kubectl.run("get", "kvcp", case.body["metadata"]["name"], check=False).returncode != 0


def test_apiserver_defaults_equal_the_model_defaults(kvcp_crd, kubectl):
    path = next(p for p in example_paths() if p.stem == "minimal")
    kubectl.apply(path)
    stored = kubectl.get_json("kvcp", "minimal")["spec"]
    from_models = _drop_empty(policy.parse_policy(yaml.safe_load(path.read_text())).spec.k8s_json())
    assert stored == from_models
    assert stored["rollout"]["steps"] == [10, 50, 100] and stored["affinity"]["spillOccupancy"] == 0.85


def _drop_empty(node):
    """The models spell absent lists as []; the apiserver leaves them out."""
    if isinstance(node, dict):
        return {k: _drop_empty(v) for k, v in node.items() if v not in ([], {})}
    return node
