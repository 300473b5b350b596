"""Every contract that crosses a process boundary has one definition (docs/ARCHITECTURE.md
"Where each contract lives"): the key root and the model identity (`kvtier.keys`), the
KV dtypes and bytes per token (`kvtier.dtypes`, `kvtier.presets.ModelShape`), the pod's
annotation and env names (`kvtier.names`), the control API's routes and answers
(`kvtier.control_api`), the operator's flags and env (`kvtier_operator.options`). Each
test reads the sources the way the layering linter does, or the model the others are
generated from, and fails naming what spells a contract again."""
from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from dataclasses import fields
from typing import get_args

import pytest

from kvtier import breakeven, control_api, layout, names, policy, presets
from kvtier.cache import CacheStats
from kvtier.dtypes import DEFAULT_KV_DTYPE, KvDtype
from kvtier.identity import ModelIdentity, WireRoot
from kvtier.keys import KEY_ROOT_FIELDS, KeyRoot
from kvtier.sidecar_config import ServedModel
from kvtier_app import reference_transformer

ROOT = Path(__file__).resolve().parents[1]
# Everything that ships or drives what ships; tests may spell contracts out (that is
# how they check them).
SOURCE_DIRS = ("kvtier", "sidecar/kvtier_sidecar", "connector/kvtier_vllm", "operator/kvtier_operator",
               "apps/kvtier_app", "testenv/kvtier_testenv", "bench")
# A node naming this many of the key root's fields is spelling it out.
SPELLED_OUT = 4


def _sources() -> Iterator[tuple[str, ast.Module]]:
    for top in SOURCE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            yield rel, ast.parse(path.read_text(), filename=rel)


def _docstrings(tree: ast.Module) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _strings(tree: ast.Module) -> Iterator[ast.Constant]:
    """String constants of the code (docstrings are prose, not names)."""
    skip = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            yield node


def _copied_root_fields(node: ast.AST) -> set[str]:
    """Key-root fields a call or literal copies one by one: `x.field`, `x["field"]`,
    `{"field": ...}` and `field=<attribute or item>`."""
    fields = set(KEY_ROOT_FIELDS)
    found = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and sub.attr in fields:
            found.add(sub.attr)
        elif isinstance(sub, ast.Subscript) and isinstance(sub.slice, ast.Constant) and sub.slice.value in fields:
            found.add(sub.slice.value)
        elif isinstance(sub, ast.Dict):
            found |= {k.value for k in sub.keys if isinstance(k, ast.Constant) and k.value in fields}
        elif isinstance(sub, ast.keyword) and sub.arg in fields and isinstance(sub.value, (ast.Attribute, ast.Subscript)):
            found.add(sub.arg)
    return found


# The one translation between the CRD's names (`id`, `attnImpl`) and the identity's.
CRD_MAPPING = ("kvtier/policy.py", {"identity", "identity_wire"})


def test_the_key_root_is_spelled_out_in_keys_and_identity_only():
    bad = []
    for rel, tree in _sources():
        if rel in ("kvtier/keys.py", "kvtier/identity.py"):
            continue
        allowed = set()
        if rel == CRD_MAPPING[0]:
            allowed = {id(n) for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name in CRD_MAPPING[1]}
        for node in ast.walk(tree):
            if id(node) in allowed:
                allowed |= {id(n) for n in ast.walk(node)}
                continue
            if isinstance(node, (ast.Call, ast.Dict)) and len(_copied_root_fields(node)) >= SPELLED_OUT:
                bad.append(f"{rel}:{node.lineno} copies {sorted(_copied_root_fields(node))}")
            elif isinstance(node, ast.ClassDef):
                declared = {s.target.id for s in node.body
                            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
                if len(declared & set(KEY_ROOT_FIELDS)) >= SPELLED_OUT:
                    bad.append(f"{rel}:{node.lineno} class {node.name} declares the key root's fields again")
    assert not bad, "use KeyRoot.to_wire/from_wire, WireRoot or ModelIdentity (kvtier.keys, kvtier.identity):\n" + "\n".join(bad)


def test_the_guard_sees_a_root_spelled_out():
    spelled = ast.parse('{"tenant": r.tenant, "model_id": r.model_id, "kv_dtype": r.kv_dtype, "attn_impl_id": x}')
    assert len(_copied_root_fields(spelled.body[0].value)) == SPELLED_OUT
    copied = ast.parse("KeyRoot(w.tenant, w.model_id, w.weights_version, w.kv_dtype, w.rope_config_hash, w.attn_impl_id)")
    assert _copied_root_fields(copied.body[0].value) == set(KEY_ROOT_FIELDS)


def test_a_key_root_round_trips_its_wire_form_and_refuses_anything_else():
    root = KeyRoot("t/a", "m", "sha256:1", "fp16", "rope-x", "sdpa")
    assert list(root.to_wire()) == list(KEY_ROOT_FIELDS) == list(WireRoot.model_fields)
    back = KeyRoot.from_wire(root.to_wire())
    assert back == root and back.digest() == root.digest()
    assert WireRoot.of(root).key_root() == root
    assert root.identity().root("t/a") == root and root.with_tenant("u") == root.identity().root("u")
    for bad in ([], "root", {**root.to_wire(), "extra": "x"}, {**root.to_wire(), "tenant": "a b"},
                {k: v for k, v in root.to_wire().items() if k != "kv_dtype"}):
        with pytest.raises(ValueError):
            KeyRoot.from_wire(bad)


def test_one_model_identity_with_one_set_of_defaults():
    from kvtier_vllm.config import EngineIdentity

    assert EngineIdentity is ModelIdentity and issubclass(ServedModel, ModelIdentity)
    assert list(ModelIdentity.model_fields) == list(KEY_ROOT_FIELDS[1:])
    spec = policy.ModelSpec(id="m", weights_version="sha256:" + "0" * 64, preset="llama-3-8b")
    defaults, served = ModelIdentity(), ServedModel()
    for name in ("kv_dtype", "rope_config_hash", "attn_impl_id"):
        assert getattr(spec.identity(), name) == getattr(defaults, name) == getattr(served, name)
    assert defaults.kv_dtype == DEFAULT_KV_DTYPE.value and served.dtype_bytes == DEFAULT_KV_DTYPE.itemsize
    ident = spec.identity()
    assert policy.ModelSpec.model_validate({**policy.ModelSpec.identity_wire(ident), "preset": "llama-3-8b"}) == spec


def test_one_kv_dtype_vocabulary():
    assert get_args(policy.ModelSpec.model_fields["kv_dtype"].annotation) == tuple(d.value for d in KvDtype)
    assert set(layout.KV_DTYPES) == set(breakeven.KV_DTYPE_BYTES) == {d.value for d in KvDtype}
    assert set(reference_transformer.COMPUTE_DTYPES) < set(layout.KV_DTYPES)
    dtype_names = {d.value for d in KvDtype}
    tables = []
    for rel, tree in _sources():
        if rel == "kvtier/dtypes.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict):
                keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
                if len(keys & dtype_names) >= 2:
                    tables.append(f"{rel}:{node.lineno}")
    assert not tables, "a table of KV dtypes outside kvtier.dtypes (derive it from KvDtype): " + ", ".join(tables)


@pytest.mark.parametrize("name", sorted(presets.MODELS))
@pytest.mark.parametrize("dtype", list(KvDtype))
def test_every_kv_size_is_the_model_shapes(name, dtype):
    shape = presets.MODELS[name]
    per_token = shape.kv_bytes_per_token(dtype)
    served = ServedModel(layers=shape.layers, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                         dtype_bytes=dtype.itemsize, kv_elements_per_token=shape.kv_elements_per_token)
    assert served.kv_bytes_per_token() == per_token
    assert breakeven.evaluate(shape, tflops_per_gpu=100, kv_dtype=dtype.value).kv_bytes_per_token == per_token
    if shape.kv_elements_per_token is None:  # the canonical layout holds K and V only
        assert layout.KVShape(shape.layers, shape.kv_heads, shape.head_dim, dtype.value).kv_bytes_per_token == per_token
        assert breakeven.kv_bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim, dtype.itemsize) == per_token


_KV_FORMULA = re.compile(r"layers\b[^\n]*\*[^\n]*kv_heads\b[^\n]*\*[^\n]*head_dim|"
                         r"kv_heads\b[^\n]*\*[^\n]*head_dim\b[^\n]*\*[^\n]*layers")


def test_kv_bytes_per_token_has_one_formula():
    found = [f"{rel}:{i}" for top in SOURCE_DIRS for path in sorted((ROOT / top).rglob("*.py"))
             if (rel := path.relative_to(ROOT).as_posix()) != "kvtier/presets.py"
             for i, line in enumerate(path.read_text().splitlines(), 1)
             if _KV_FORMULA.search(line.split("#")[0])]
    assert not found, "KV size computed by hand (use presets.ModelShape / kv_bytes_per_token): " + ", ".join(found)


# A `kvtier.io/` name, not a URL under the domain (https://kvtier.io/schemas/...).
_OUR_NAME = re.compile(r"(?<![/\w.-])kvtier\.io/")


def test_pod_names_are_spelled_in_kvtier_names_only():
    bad = []
    for rel, tree in _sources():
        if rel == "kvtier/names.py":
            continue
        for node in _strings(tree):
            if _OUR_NAME.search(node.value):
                bad.append(f"{rel}:{node.lineno} {node.value!r}")
            elif node.value in names.POD_ENV:
                bad.append(f"{rel}:{node.lineno} env {node.value!r}")
        for node in ast.walk(tree):  # a downward-API env entry: names.field_env builds them
            if isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "fieldRef"
                                                  for k in node.keys):
                parent_keys = [k.value for k in node.keys if isinstance(k, ast.Constant)]
                if "path" not in parent_keys:  # a downwardAPI volume item is not an env entry
                    bad.append(f"{rel}:{node.lineno} a fieldRef env entry")
    assert not bad, "use kvtier.names:\n" + "\n".join(bad)


def test_the_operator_and_the_pod_read_the_same_names():
    from kvtier_operator import names as operator_names

    for name in ("PREFIX", "INJECTED_ANNOTATION", "WEIGHTS_VERSION_ANNOTATION", "WEIGHT_ANNOTATION"):
        assert getattr(operator_names, name) == getattr(names, name)
    assert names.weights_version_env() == {"name": names.WEIGHTS_VERSION_ENV, "valueFrom": {"fieldRef": {
        "fieldPath": f"metadata.annotations['{names.WEIGHTS_VERSION_ANNOTATION}']"}}}
    assert policy.GROUP == names.GROUP and names.WEIGHTS_VERSION_ANNOTATION.startswith(names.GROUP + "/")


# Paths other servers serve, which only share a name with a control API route.
OTHER_SERVERS = {
    ("operator/kvtier_operator/metrics.py", "/metrics"),  # the operator's own Prometheus endpoint
    ("testenv/kvtier_testenv/controlplane.py", "/readyz"),  # kube-apiserver's
    ("testenv/kvtier_testenv/vllm_serve.py", "/metrics"),  # vllm serve's
    ("testenv/kvtier_testenv/nodes.py", "/healthz"),  # kubelet's
}


def _control_path(value: str) -> bool:
    """A control API path, with or without a query, or anything under /cache/."""
    return value.startswith(control_api.PROTECTED_PREFIX) or any(
        value == r.path or value.startswith(r.path + "?") for r in control_api.ROUTES)


def test_control_api_paths_are_spelled_in_the_route_table_only():
    bad = [f"{rel}:{node.lineno} {node.value!r}" for rel, tree in _sources() if rel != "kvtier/control_api.py"
           for node in _strings(tree) if _control_path(node.value) and (rel, node.value) not in OTHER_SERVERS]
    assert not bad, "build the URL from kvtier.control_api.ROUTES (STATS.url(...), HEALTHZ.path):\n" + "\n".join(bad)


def test_the_route_guard_sees_a_path_spelled_out():
    tree = ast.parse('get("/cache/stats?tenant=" + t); post(f"{base}/cache/warm"); probe("/healthz")')
    assert {n.value for n in _strings(tree) if _control_path(n.value)} == {"/cache/stats?tenant=", "/cache/warm",
                                                                           "/healthz"}


def test_the_route_table_is_whole_and_the_sidecar_serves_exactly_it():
    from kvtier_sidecar import http_api

    routes = control_api.ROUTES
    assert len({r.name for r in routes}) == len({(r.method, r.path) for r in routes}) == len(routes)
    app = http_api.make_app(service=None)
    served = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    assert served == {(r.method, r.path) for r in routes}
    assert {r.path for r in routes if r.protected} == {"/cache/stats", "/cache/invalidate", "/cache/warm",
                                                       "/cache/drain/done", "/cache/jobs", "/cache/hot"}
    assert control_api.STATS.url("https://h:1", tenant="t/a") == "https://h:1/cache/stats?tenant=t%2Fa"
    assert control_api.STATS.url(tenant=None) == "/cache/stats"


def test_the_wire_cache_report_carries_every_figure_of_the_cache_snapshot():
    """`CacheReport` is the wire's, `CacheStats` the core's: each figure of one is a
    field of the other, so none is computed and dropped (nor invented)."""
    assert list(control_api.CacheReport.model_fields) == [f.name for f in fields(CacheStats)]
    assert not hasattr(control_api, "CacheStats")  # the internal snapshot is not on the wire


def test_every_figure_the_sidecar_counts_has_a_field_in_the_stats_answer():
    from kvtier_sidecar.metrics import TenantCounters

    assert set(TenantCounters().as_dict()) <= set(control_api.TenantStats.model_fields)
    with pytest.raises(ValueError, match="computed_and_dropped"):
        control_api.TenantStats(**TenantCounters().as_dict(), computed_and_dropped=1)


# The operator's flags and env names as the chart, operator/deploy/ and the tests pass
# them: each must keep working.
OPERATOR_FLAGS = {
    "--sidecar-image", "--sidecar-image-pull-policy", "--native-sidecars", "--webhook-host", "--webhook-port", "--webhook-cert", "--webhook-key",
    "--warms-per-target", "--sidecar-auth", "--sidecar-auth-user", "--sidecar-protect-metrics",
    "--sidecar-metrics-user", "--sidecar-token-file", "--sidecar-token-service-account", "--sidecar-plain-http",
    "--control-ca-secret", "--network-policies", "--operator-namespace", "--operator-pod-labels",
    "--monitoring-namespace", "--close-serving-ports", "--metrics-port", "--metrics-host"}
OPERATOR_ENV = {"KVTIER_OPERATOR_" + n for n in (
    "SIDECAR_IMAGE", "SIDECAR_IMAGE_PULL_POLICY", "WEBHOOK_HOST", "WEBHOOK_PORT", "WEBHOOK_CERT", "WEBHOOK_KEY", "RESYNC_INTERVAL_S", "DEBOUNCE_S",
    "WARMS_PER_TARGET", "SIDECAR_AUTH", "SIDECAR_AUTH_USERS", "SIDECAR_PROTECT_METRICS", "SIDECAR_METRICS_USERS",
    "SIDECAR_TOKEN_FILE", "SIDECAR_TOKEN_SERVICE_ACCOUNT", "SIDECAR_TLS", "CONTROL_CA_SECRET", "NETWORK_POLICIES",
    "OPERATOR_NAMESPACE", "OPERATOR_POD_LABELS", "MONITORING_NAMESPACE", "SERVING_PORTS_OPEN", "METRICS_HOST",
    "METRICS_PORT", "NATIVE_SIDECARS", "FIRST_MINUTE_S")}


def _options_unlike_the_defaults():
    from kvtier_operator.options import OperatorOptions

    options = OperatorOptions(
        sidecar_image="registry.example/kvtier:x", sidecar_image_pull_policy="Never", native_sidecars="auto", webhook_host="10.0.0.1", webhook_port=1,
        webhook_cert="/c.pem", webhook_key="/k.pem", resync_interval_s=1.5, debounce_s=0.05, warms_per_target=3,
        first_minute_s=5.0,
        metrics_host="10.0.0.2", metrics_port=9, sidecar_auth="open", sidecar_auth_users=["a:b", "c"],
        sidecar_protect_metrics=True, sidecar_metrics_users=["m"], sidecar_token_file="/t",
        sidecar_token_service_account="ns/sa", sidecar_tls=False, control_ca_secret="ca", network_policies=True,
        operator_namespace="ns", operator_pod_labels={"a": "1", "b.io/c": "2"}, monitoring_namespace="mon",
        serving_ports_open=False)
    same = [n for n, f in OperatorOptions.model_fields.items() if getattr(options, n) == f.get_default(
        call_default_factory=True)]
    assert not same, f"give these a value unlike the default here: {same}"
    return options


def test_every_operator_setting_has_one_flag_and_one_env_name_generated_from_the_model():
    from kvtier_operator.main import _parser
    from kvtier_operator.options import OperatorOptions

    parser = _parser()
    by_dest = {a.dest: a.option_strings for a in parser._actions}
    for name in OperatorOptions.model_fields:
        assert by_dest.get(name) == [OperatorOptions.flag_name(name)], name
        assert OperatorOptions.model_fields[name].description, f"{name}: its flag's help is the description"
    options = _options_unlike_the_defaults()
    assert set(options.to_env()) == {OperatorOptions.env_name(n) for n in OperatorOptions.model_fields} == OPERATOR_ENV
    assert OPERATOR_FLAGS <= {OperatorOptions.flag_name(n) for n in OperatorOptions.model_fields}


def test_the_flags_and_the_env_read_back_as_the_model():
    from kvtier_operator.main import _parser
    from kvtier_operator.options import OperatorOptions

    parser = _parser()
    for options in (_options_unlike_the_defaults(), OperatorOptions()):
        assert OperatorOptions.from_args(parser.parse_args(options.to_argv())) == options
        assert OperatorOptions.from_env(options.to_env()) == options
    assert OperatorOptions.from_args(parser.parse_args([])) == OperatorOptions() == OperatorOptions.from_env({})
    given = parser.parse_args(["--sidecar-auth-user=a", "--sidecar-auth-user=b", "--close-serving-ports",
                               "--operator-pod-labels=x=1,y=2", "--sidecar-plain-http"])
    read = OperatorOptions.from_args(given)
    assert (read.sidecar_auth_users, read.serving_ports_open, read.sidecar_tls) == (["a", "b"], False, False)
    assert read.operator_pod_labels == {"x": "1", "y": "2"}
    assert OperatorOptions.from_env({"KVTIER_OPERATOR_SIDECAR_AUTH_USERS": "a,b"}).sidecar_auth_users == ["a", "b"]
    with pytest.raises(ValueError, match="sidecar_auth"):
        OperatorOptions.from_env({"KVTIER_OPERATOR_SIDECAR_AUTH": "none"})


def test_operator_settings_no_flag_gives_come_from_the_env(monkeypatch):
    """The chart's operator.extraEnv reaches the deployed operator: `kvtier-operator`
    takes KVTIER_OPERATOR_<FIELD> for what its flags leave unset; a flag wins."""
    from kvtier_operator.main import _parser
    from kvtier_operator.options import OperatorOptions

    monkeypatch.setenv("KVTIER_OPERATOR_FIRST_MINUTE_S", "20")
    parser = _parser()
    assert OperatorOptions.from_args(parser.parse_args([])).first_minute_s == 20
    assert OperatorOptions.from_args(parser.parse_args(["--first-minute-s=5"])).first_minute_s == 5


def test_the_deployed_operators_flags_parse_as_settings():
    import yaml

    from kvtier_operator.main import _parser
    from kvtier_operator.options import OperatorOptions

    docs = list(yaml.safe_load_all((ROOT / "operator" / "deploy" / "operator.yaml").read_text()))
    deploy = next(d for d in docs if d and d["kind"] == "Deployment")
    args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    options = OperatorOptions.from_args(_parser().parse_args(args))
    assert options.sidecar_auth_users == ["system:serviceaccount:kvtier-system:kvtier-operator"]
    assert options.operator_pod_labels == {"app.kubernetes.io/name": "kvtier-operator",
                                           "app.kubernetes.io/instance": "kvtier"}
