"""The chart's kvtier Endpoint Picker (endpointPicker.*), rendered by the real helm: off
by default; on, one EPP per pool (ServiceAccount, Role, RoleBinding, its
EndpointPickerConfig, Deployment, Service, NetworkPolicy) in the policy's namespace,
mounting the policy's affinity ConfigMap, with the upstream runner's flags; the
InferencePool only where the API server serves it (or when forced); and the schema's
rejections. The restricted-PSS admission and checkov runs over the enabled render are in
test_chart_pod_security.py and test_chart_checkov.py."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from helm_chart import CHART, ROOT, flags, helm, render
from kvtier_operator import names

POOL_API = "inference.networking.k8s.io/v1/InferencePool"
POOL = {"name": "llama", "namespace": "serving", "policy": "llama-70b", "selector": {"app": "vllm"}}
ON = {"endpointPicker": {"enabled": True, "pools": [POOL]}}
EPP_KINDS = {"ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Deployment", "Service", "NetworkPolicy"}


def epp_objects(objects: dict) -> dict:
    return {k: o for k, o in objects.items()
            if (o["metadata"].get("labels") or {}).get("app.kubernetes.io/name") == "kvtier-epp"}


def with_pool(**pool) -> dict:
    return {"endpointPicker": {"enabled": True, "pools": [{**POOL, **pool}]}}


def epp_container(objects: dict, name: str = "llama-epp") -> dict:
    [container] = objects[("Deployment", name)]["spec"]["template"]["spec"]["containers"]
    return container


def epp_config(objects: dict, name: str = "llama-epp") -> dict:
    return yaml.safe_load(objects[("ConfigMap", name)]["data"]["config.yaml"])


def test_off_by_default_and_the_default_render_is_unchanged_by_its_values():
    default = render()
    assert epp_objects(default) == {}
    # enabled without pools, or pools while disabled: nothing either
    assert epp_objects(render({"endpointPicker": {"enabled": True}})) == {}
    assert epp_objects(render({"endpointPicker": {"enabled": False, "pools": [POOL]}})) == {}
    assert render({"endpointPicker": {"enabled": False, "pools": [POOL]}}).keys() == default.keys()


def test_enabled_renders_one_picker_per_pool_in_the_policys_namespace():
    objects = render(ON, extra=["--api-versions", POOL_API])
    epp = epp_objects(objects)
    assert set(epp) == {(kind, "llama-epp") for kind in EPP_KINDS} | {("InferencePool", "llama")}
    assert {o["metadata"]["namespace"] for o in epp.values()} == {"serving"}
    # the operator's objects are untouched
    assert set(objects) - set(epp) == set(render())

    dep = objects[("Deployment", "llama-epp")]
    selector = dep["spec"]["selector"]["matchLabels"]
    assert selector == {"app.kubernetes.io/name": "kvtier-epp", "app.kubernetes.io/instance": "kvtier",
                        "kvtier.io/inference-pool": "llama"}
    pod = dep["spec"]["template"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert pod["metadata"]["labels"]["kvtier.io/inject"] == "false"  # the webhook leaves it alone
    assert objects[("Service", "llama-epp")]["spec"]["selector"] == selector
    assert {(p["name"], p["port"]) for p in objects[("Service", "llama-epp")]["spec"]["ports"]} == {
        ("grpc-ext-proc", 9002), ("http-metrics", 9090)}
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}

    spec = pod["spec"]
    assert spec["serviceAccountName"] == "llama-epp"
    container = epp_container(objects)
    assert container["image"] == "ghcr.io/kvtier/kvtier-epp:0.1.0"
    args = flags(container)
    assert args["pool-name"] == "llama" and args["pool-namespace"] == "serving"
    assert args["pool-group"] == "inference.networking.k8s.io"
    assert args["config-file"] == "/etc/kvtier-epp/config.yaml"
    assert (args["grpc-port"], args["grpc-health-port"], args["metrics-port"]) == ("9002", "9003", "9090")
    assert args["metrics-endpoint-auth"] == "false" and args["enable-pprof"] == "false"
    assert "ha-enable-leader-election" not in args
    assert {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]} == {
        "NAMESPACE": "metadata.namespace", "POD_NAME": "metadata.name"}
    assert {(p["name"], p["containerPort"]) for p in container["ports"]} == {
        ("grpc", 9002), ("grpc-health", 9003), ("metrics", 9090)}
    assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": "inference-extension"}
    assert container["resources"]["requests"] and container["resources"]["limits"]

    # the config and the policy's affinity table, both mounted read-only
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["config"]["configMap"]["name"] == "llama-epp"
    assert mounts["config"]["mountPath"] == "/etc/kvtier-epp" and mounts["config"]["readOnly"]
    assert volumes["affinity"]["configMap"] == {"name": names.affinity_config_map("llama-70b"), "optional": True}
    assert mounts["affinity"]["readOnly"] and "subPath" not in mounts["affinity"]  # subPath never updates

    config = epp_config(objects)
    assert config["kind"] == "EndpointPickerConfig"
    plugins = {p["type"]: p.get("parameters") for p in config["plugins"]}
    assert set(plugins) == {"kvtier-version-screener", "kvtier-affinity-scorer", "kvtier-cache-salt",
                            "max-score-picker"}
    scorer = plugins["kvtier-affinity-scorer"]
    # The screener reads the same table and tenant; the pods' version label is its default.
    assert plugins["kvtier-version-screener"] == scorer
    assert scorer["tablePath"] == f"{mounts['affinity']['mountPath']}/{names.AFFINITY_KEY}"
    assert (scorer["tenantHeader"], scorer["defaultTenant"]) == ("x-tenant-id", "default")
    assert "redisUrl" not in scorer
    assert plugins["kvtier-cache-salt"] == {"tenantHeader": "x-tenant-id"}
    assert [p["pluginRef"] for p in config["schedulingProfiles"][0]["plugins"]] == [
        "kvtier-version-screener", "kvtier-affinity-scorer", "max-score-picker"]

    role = objects[("Role", "llama-epp")]
    assert all(set(r["verbs"]) <= {"get", "list", "watch"} for r in role["rules"])
    assert {res for r in role["rules"] for res in r["resources"]} == {
        "pods", "inferencepools", "inferenceobjectives", "inferencemodelrewrites"}
    binding = objects[("RoleBinding", "llama-epp")]
    assert binding["roleRef"]["name"] == "llama-epp"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llama-epp", "namespace": "serving"}]

    pool = objects[("InferencePool", "llama")]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"] == {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": 8000}],
                            "endpointPickerRef": {"kind": "Service", "name": "llama-epp", "port": {"number": 9002},
                                                  "failureMode": "FailOpen"}}


def test_the_config_change_restarts_the_picker():
    a = render(ON)[("Deployment", "llama-epp")]["spec"]["template"]["metadata"]["annotations"]
    b = render(with_pool(tenantHeader="x-org"))[("Deployment", "llama-epp")]["spec"]["template"]["metadata"]
    assert a["kvtier.io/epp-config"] != b["annotations"]["kvtier.io/epp-config"]


@pytest.mark.parametrize("mode, api, rendered", [
    ("auto", False, False), ("auto", True, True), ("always", False, True), ("never", True, False)])
def test_inference_pool_only_where_the_api_server_serves_it_or_forced(mode, api, rendered):
    values = {"endpointPicker": {**ON["endpointPicker"], "inferencePool": mode}}
    objects = render(values, extra=["--api-versions", POOL_API] if api else None)
    assert (("InferencePool", "llama") in objects) == rendered
    assert ("Deployment", "llama-epp") in objects  # the picker itself either way


def test_custom_pool_values_reach_the_objects():
    values = {"endpointPicker": {
        "enabled": True, "replicas": 2, "grpcPort": 19002, "failureMode": "FailClose", "secureServing": False,
        "image": {"repository": "registry.local/epp", "digest": "sha256:" + "a" * 64, "pullPolicy": "Always"},
        "extraArgs": ["--refresh-metrics-interval=100ms"], "inferencePool": "always",
        "pools": [
            {**POOL, "targetPort": 8080, "tenantHeader": "x-org", "defaultTenant": "public", "cacheSalt": False,
             "redisUrl": "redis://kvtier-redis.serving:6380/2"},
            {"name": "mistral", "policy": "mistral-7b", "selector": {"app": "mistral", "tier": "gpu"}},
        ]}}
    objects = render(values)
    assert {(k, o["metadata"]["namespace"]) for k, o in epp_objects(objects).items()} == (
        {((kind, "llama-epp"), "serving") for kind in EPP_KINDS} | {(("InferencePool", "llama"), "serving")}
        | {((kind, "mistral-epp"), "kvtier-system") for kind in EPP_KINDS}
        | {(("InferencePool", "mistral"), "kvtier-system")})
    container = epp_container(objects)
    assert container["image"] == "registry.local/epp@sha256:" + "a" * 64
    args = flags(container)
    assert args["grpc-port"] == "19002" and args["secure-serving"] == "false"
    assert "ha-enable-leader-election" in args and args["refresh-metrics-interval"] == "100ms"
    assert container["livenessProbe"]["grpc"]["service"] == "liveness"
    assert container["readinessProbe"]["grpc"]["service"] == "readiness"
    lease = [r for r in objects[("Role", "llama-epp")]["rules"] if "leases" in r["resources"]]
    assert lease == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                      "verbs": ["get", "create", "update"]}]
    assert "checkov.io/skip2" not in objects[("Deployment", "llama-epp")]["metadata"]["annotations"]

    plugins = {p["type"]: p.get("parameters") for p in epp_config(objects)["plugins"]}
    assert "kvtier-cache-salt" not in plugins
    assert plugins["kvtier-affinity-scorer"] == {
        "tablePath": "/etc/kvtier-affinity/table.json", "tenantHeader": "x-org", "defaultTenant": "public",
        "redisUrl": "redis://kvtier-redis.serving:6380/2",
        "redisKey": names.REDIS_AFFINITY_KEY.format(namespace="serving", name="llama-70b")}
    assert plugins["kvtier-version-screener"] == plugins["kvtier-affinity-scorer"]
    pool = objects[("InferencePool", "llama")]["spec"]
    assert pool["targetPorts"] == [{"number": 8080}] and pool["endpointPickerRef"]["port"] == {"number": 19002}
    assert pool["endpointPickerRef"]["failureMode"] == "FailClose"
    assert objects[("InferencePool", "mistral")]["spec"]["selector"]["matchLabels"] == {"app": "mistral",
                                                                                        "tier": "gpu"}
    # egress: the Redis port from the URL, the serving pods' port; ingress: the gRPC port
    netpol = objects[("NetworkPolicy", "llama-epp")]["spec"]
    egress_ports = {(p["protocol"], p["port"]) for rule in netpol["egress"] for p in rule["ports"]}
    assert {("TCP", 6380), ("TCP", 8080), ("UDP", 53), ("TCP", 443)} <= egress_ports
    serving = [r for r in netpol["egress"] if r["ports"] == [{"protocol": "TCP", "port": 8080}]]
    assert serving[0]["to"] == [{"podSelector": {"matchLabels": {"app": "vllm"}}}]
    assert ("TCP", 6380) not in {(p["protocol"], p["port"]) for rule in
                                 objects[("NetworkPolicy", "mistral-epp")]["spec"]["egress"] for p in rule["ports"]}
    assert netpol["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 19002}]


def test_redis_password_secret_is_mounted_and_named_to_the_scorer_only_when_set():
    """endpointPicker.redis.passwordSecret (off by default): for a pool with a redisUrl,
    the Secret's key mounted as a file (a directory mount, so a rotated Secret reaches
    the file) and named by redisPasswordFile in the screener's and scorer's parameters;
    a pool's redisPasswordSecret overrides it; a pool without a redisUrl gets none."""
    url = "redis://kvtier-redis.serving:6379"

    def picker(objects: dict, name: str = "llama-epp") -> tuple[dict, dict, dict]:
        spec = objects[("Deployment", name)]["spec"]["template"]["spec"]
        plugins = {p["type"]: p.get("parameters") for p in epp_config(objects, name)["plugins"]}
        return ({m["name"]: m for m in spec["containers"][0]["volumeMounts"]},
                {v["name"]: v for v in spec["volumes"]}, plugins)

    mounts, volumes, plugins = picker(render(with_pool(redisUrl=url)))
    assert "redis-password" not in mounts and "redis-password" not in volumes
    assert "redisPasswordFile" not in plugins["kvtier-affinity-scorer"]

    values = {"endpointPicker": {
        "enabled": True, "redis": {"passwordSecret": {"name": "kvtier-redis-auth", "key": "redis-password"}},
        "pools": [{**POOL, "redisUrl": url},
                  {"name": "mistral", "policy": "mistral-7b", "selector": {"app": "mistral"}, "redisUrl": url,
                   "redisPasswordSecret": {"name": "mistral-redis"}},
                  {"name": "phi", "policy": "phi-3", "selector": {"app": "phi"}}]}}
    objects = render(values)
    mounts, volumes, plugins = picker(objects)
    assert mounts["redis-password"] == {"name": "redis-password", "mountPath": "/etc/kvtier-redis", "readOnly": True}
    assert "subPath" not in mounts["redis-password"]
    assert volumes["redis-password"]["secret"] == {
        "secretName": "kvtier-redis-auth", "items": [{"key": "redis-password", "path": "password"}]}
    for plugin in ("kvtier-affinity-scorer", "kvtier-version-screener"):
        assert plugins[plugin]["redisPasswordFile"] == "/etc/kvtier-redis/password"
        assert plugins[plugin]["redisUrl"] == url  # no password in the ConfigMap
    _, volumes, _ = picker(objects, "mistral-epp")
    assert volumes["redis-password"]["secret"] == {
        "secretName": "mistral-redis", "items": [{"key": "password", "path": "password"}]}
    mounts, volumes, plugins = picker(objects, "phi-epp")
    assert "redis-password" not in volumes and "redisPasswordFile" not in plugins["kvtier-affinity-scorer"]


def test_network_policy_admits_the_gateway_and_the_monitoring_namespace_only():
    gateway = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "envoy-gateway-system"}}}]
    api = [{"ipBlock": {"cidr": "10.0.0.1/32"}}]
    objects = render({"endpointPicker": {**ON["endpointPicker"], "gatewayFrom": gateway, "apiServerTo": api}})
    spec = objects[("NetworkPolicy", "llama-epp")]["spec"]
    assert spec["podSelector"]["matchLabels"] == \
        objects[("Deployment", "llama-epp")]["spec"]["selector"]["matchLabels"]
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    grpc, _health, metrics = spec["ingress"]
    assert grpc == {"ports": [{"protocol": "TCP", "port": 9002}], "from": gateway}
    assert metrics["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    [apiserver] = [r for r in spec["egress"] if {"protocol": "TCP", "port": 6443} in r["ports"]]
    assert apiserver["to"] == api
    assert ("NetworkPolicy", "llama-epp") not in render({**ON, "networkPolicy": {"enabled": False}})


def test_runner_flags_the_chart_passes_exist_in_the_pinned_epp_module():
    """Every flag in the rendered args is one the GIE runner (the version router/epp/go.mod
    pins) defines, read from its source in Go's module cache."""
    version = re.search(r"sigs\.k8s\.io/gateway-api-inference-extension (v\S+)",
                        (ROOT / "router" / "epp" / "go.mod").read_text()).group(1)
    try:
        modcache = subprocess.run(["go", "env", "GOMODCACHE"], capture_output=True, text=True,
                                  check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pytest.fail("no Go toolchain: scripts/setup.sh needs Go >= 1.26 on PATH")
    src = Path(modcache) / f"sigs.k8s.io/gateway-api-inference-extension@{version}"
    if not src.is_dir():
        pytest.fail(f"{src} is not in Go's module cache: scripts/setup.sh downloads it "
                    "(cd router/epp && go mod download sigs.k8s.io/gateway-api-inference-extension)")
    defined = set(re.findall(r'fs\.\w+Var\w*\(&opts\.\w+(?:\.\w+)*,\s*"([a-z0-9-]+)"',
                             (src / "pkg/epp/server/options.go").read_text()))
    defined |= set(re.findall(r'fs\.\w+VarP?\([^,]+,\s*"([a-z0-9-]+)"',
                              (src / "pkg/common/observability/logging/options.go").read_text()))
    assert {"pool-name", "config-file", "grpc-port", "v"} <= defined
    values = {"endpointPicker": {**ON["endpointPicker"], "replicas": 2}}
    used = set(flags(epp_container(render(values))))
    assert used <= defined, used - defined


@pytest.mark.parametrize("pool, message", [
    ({"name": "llama", "selector": {"app": "vllm"}}, "at '/endpointPicker/pools/0': missing property 'policy'"),
    ({"name": "llama", "policy": "p"}, "at '/endpointPicker/pools/0': missing property 'selector'"),
    ({**POOL, "selector": {}}, "at '/endpointPicker/pools/0/selector': minProperties"),
    ({**POOL, "name": "Llama"}, "at '/endpointPicker/pools/0/name'"),
    ({**POOL, "name": "l" * 60}, "at '/endpointPicker/pools/0/name'"),
    ({**POOL, "redisUrl": "redis://:hunter2@redis:6379"}, "at '/endpointPicker/pools/0/redisUrl'"),
    ({**POOL, "targetPort": 0}, "at '/endpointPicker/pools/0/targetPort': minimum"),
    ({**POOL, "selecter": {}}, "additional properties 'selecter' not allowed"),
    ({**POOL, "redisPasswordSecret": {"name": "s", "key": "a/b"}},
     "at '/endpointPicker/pools/0/redisPasswordSecret/key'"),
])
def test_bad_pools_fail_with_the_schema_message(pool, message):
    for argv in (("template", "x", str(CHART)), ("lint", str(CHART))):
        proc = helm(*argv, values={"endpointPicker": {"enabled": True, "pools": [pool]}}, check=False)
        assert proc.returncode != 0, f"helm {argv[0]} accepted {pool}"
        assert message in proc.stdout + proc.stderr


@pytest.mark.parametrize("values, message", [
    ({"inferencePool": "sometimes"}, "at '/endpointPicker/inferencePool': value must be one of"),
    ({"failureMode": "FailSoft"}, "at '/endpointPicker/failureMode'"),
    ({"extraArgs": ["-v 3"]}, "at '/endpointPicker/extraArgs/0'"),
    ({"redis": {"passwordSecret": {"name": "Bad_Name"}}}, "at '/endpointPicker/redis/passwordSecret/name'"),
    ({"pools": [POOL, {**POOL, "policy": "other"}]}, "two pools are named serving/llama"),
])
def test_bad_picker_values_fail_with_a_message(values, message):
    proc = helm("template", "x", str(CHART), values={"endpointPicker": {"enabled": True, **values}}, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
