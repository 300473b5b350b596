"""charts/kvtier rendered by the real helm (no cluster): lint, what the default and
custom values produce, the schema's rejections, and that the CRD copy and
operator/deploy/ are generated from their sources."""
from __future__ import annotations

import base64
import shutil
import subprocess

import pytest

from helm_chart import CHART, ROOT, SA_DIR, HelmFailed, cert_sans, flags, helm, operator_container, render, verifies
from kvtier import crd
from kvtier_app import crd_cli


def test_chart_lints_clean_with_its_schema():
    out = helm("lint", str(CHART), "--strict")
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout


def test_default_render_has_every_object_least_privilege_and_hardening():
    objects = render()
    assert set(objects) == {
        ("ServiceAccount", "kvtier-operator"), ("ClusterRole", "kvtier-operator"),
        ("ClusterRoleBinding", "kvtier-operator"), ("Deployment", "kvtier-operator"),
        ("Service", "kvtier-operator"), ("Secret", "kvtier-webhook-tls"),
        ("MutatingWebhookConfiguration", "kvtier-sidecar-injector"), ("NetworkPolicy", "kvtier-operator"),
        ("ConfigMap", "kvtier-alert-rules"), ("ConfigMap", "kvtier-dashboard"),
        ("Role", "kvtier-operator-sidecar-tokens"), ("RoleBinding", "kvtier-operator-sidecar-tokens"),
        ("Role", "kvtier-operator-control-ca"), ("RoleBinding", "kvtier-operator-control-ca"),
    }
    # The control CA: read back by name, in the release namespace only.
    assert objects[("Role", "kvtier-operator-control-ca")]["rules"] == [
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["kvtier-control-ca"], "verbs": ["get"]}]
    # The sidecars' tokens: the operator mints its own, and nobody else's.
    assert objects[("Role", "kvtier-operator-sidecar-tokens")]["rules"] == [
        {"apiGroups": [""], "resources": ["serviceaccounts/token"], "resourceNames": ["kvtier-operator"],
         "verbs": ["create"]}]
    assert "--sidecar-token-service-account=kvtier-system/kvtier-operator" in operator_container(objects)["args"]
    rules = objects[("ClusterRole", "kvtier-operator")]["rules"]
    granted = {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    assert not any(v in ("*", "deletecollection") for _, r, v in granted)
    assert not any(v == "update" for _, r, v in granted if r != "secrets")
    # Secrets, cluster-wide: create (the per-policy peer secret and control TLS Secret)
    # and update (that certificate renewed, written whole); never read, listed or patched.
    assert {v for _, r, v in granted if r == "secrets"} == {"create", "update"}
    f = flags(operator_container(objects))
    assert f["operator-namespace"] == "kvtier-system" and f["control-ca-secret"] == "kvtier-control-ca"
    assert ("", "pods", "watch") in granted and ("", "pods", "patch") not in granted
    assert ("kvtier.io", "kvcachepolicies/status", "patch") in granted

    deploy = objects[("Deployment", "kvtier-operator")]["spec"]
    assert deploy["replicas"] == 1 and deploy["strategy"] == {"type": "Recreate"}
    pod = deploy["template"]["spec"]
    assert pod["serviceAccountName"] == "kvtier-operator"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert deploy["template"]["metadata"]["labels"]["kvtier.io/inject"] == "false"
    c = operator_container(objects)
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert c["image"] == "ghcr.io/kvtier/kvtier:0.1.0"
    f = flags(c)
    assert f["liveness"] == "http://0.0.0.0:8080/healthz" and f["service-account-dir"] == SA_DIR
    assert f["webhook-port"] == "9443" and f["webhook-cert"] == "/etc/kvtier/tls/tls.crt"
    assert "namespace" not in f, "no --namespace: watches all namespaces"
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}

    hook = objects[("MutatingWebhookConfiguration", "kvtier-sidecar-injector")]["webhooks"][0]
    assert hook["failurePolicy"] == "Ignore" and hook["sideEffects"] == "None"
    assert hook["clientConfig"]["service"] == {"name": "kvtier-operator", "namespace": "kvtier-system",
                                               "path": "/inject-sidecar", "port": 443}
    assert hook["namespaceSelector"]["matchExpressions"][0]["values"] == ["kube-system", "kvtier-system"]
    assert hook["objectSelector"]["matchExpressions"][0] == {"key": "kvtier.io/inject", "operator": "NotIn",
                                                             "values": ["false"]}


def test_generated_certificate_covers_the_service_and_is_signed_by_the_ca_bundle(tmp_path):
    objects = render()
    secret = objects[("Secret", "kvtier-webhook-tls")]
    cert, ca = (base64.b64decode(secret["data"][k]) for k in ("tls.crt", "ca.crt"))
    hook = objects[("MutatingWebhookConfiguration", "kvtier-sidecar-injector")]["webhooks"][0]
    assert base64.b64decode(hook["clientConfig"]["caBundle"]) == ca
    assert verifies(cert, ca, tmp_path)
    assert {"DNS:kvtier-operator.kvtier-system.svc", "DNS:kvtier-operator.kvtier-system.svc.cluster.local"} \
        <= cert_sans(cert, tmp_path)
    other = render()[("Secret", "kvtier-webhook-tls")]["data"]["ca.crt"]
    assert not verifies(cert, base64.b64decode(other), tmp_path), "a CA of another render must not verify"


def test_custom_values_reach_the_objects(tmp_path):
    values = {
        "image": {"repository": "registry.local/kvtier", "tag": "1.2.3", "pullPolicy": "Always"},
        "sidecar": {"image": {"repository": "registry.local/kvtier-sidecar", "tag": "1.2.4"}},
        "operator": {"watchNamespaces": ["serving-a", "serving-b"], "healthPort": 18080,
                     "resources": {"requests": {"cpu": "50m"}}, "verbose": True},
        "webhook": {"url": "https://127.0.0.1:19443/inject-sidecar", "port": 19443, "failurePolicy": "Fail",
                    "excludeNamespaces": ["batch"]},
        "nodeSelector": {"node-role/control": "true"},
        "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
    }
    objects = render(values, release="prod", namespace="platform")
    c = operator_container(objects, "prod-kvtier-operator")
    assert c["image"] == "registry.local/kvtier:1.2.3" and c["imagePullPolicy"] == "Always"
    # values merge over the defaults key by key
    assert c["resources"] == {"requests": {"cpu": "50m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "512Mi"}}
    assert [a for a in c["args"] if a.startswith("--namespace=")] == ["--namespace=serving-a", "--namespace=serving-b"]
    f = flags(c)
    assert f["sidecar-image"] == "registry.local/kvtier-sidecar:1.2.4"
    assert f["liveness"] == "http://0.0.0.0:18080/healthz" and f["webhook-port"] == "19443" and "verbose" in f
    pod = objects[("Deployment", "prod-kvtier-operator")]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == values["nodeSelector"] and pod["tolerations"] == values["tolerations"]
    assert pod["affinity"] == values["affinity"]
    hook = objects[("MutatingWebhookConfiguration", "prod-kvtier-sidecar-injector")]["webhooks"][0]
    assert hook["clientConfig"]["url"] == "https://127.0.0.1:19443/inject-sidecar"
    assert "service" not in hook["clientConfig"] and hook["failurePolicy"] == "Fail"
    assert hook["namespaceSelector"]["matchExpressions"][0]["values"] == ["kube-system", "platform", "batch"]
    cert = base64.b64decode(objects[("Secret", "prod-kvtier-webhook-tls")]["data"]["tls.crt"])
    assert "IP Address:127.0.0.1" in cert_sans(cert, tmp_path), "the URL's host is in the certificate"


def test_user_provided_certificate_renders_no_secret_and_uses_the_given_ca_bundle():
    objects = render({"webhook": {"tls": {"secretName": "from-cert-manager", "caBundle": "Q0EK"}}})
    assert not any(kind == "Secret" for kind, _ in objects)
    hook = objects[("MutatingWebhookConfiguration", "kvtier-sidecar-injector")]["webhooks"][0]
    assert hook["clientConfig"]["caBundle"] == "Q0EK"
    pod = objects[("Deployment", "kvtier-operator")]["spec"]["template"]["spec"]
    assert pod["volumes"][0] == {"name": "webhook-tls", "secret": {"secretName": "from-cert-manager"}}


def test_webhook_disabled_renders_no_webhook_service_or_flags():
    objects = render({"webhook": {"enabled": False}})
    assert {kind for kind, _ in objects} == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment",
                                             "NetworkPolicy", "ConfigMap",  # ConfigMap: the monitoring ones
                                             "Role", "RoleBinding"}  # the operator mints the sidecars' tokens
    assert not any(a.startswith("--webhook") for a in operator_container(objects)["args"])


@pytest.mark.parametrize("values, message", [
    ({"webhook": {"failurePolicy": "Sometimes"}}, "at '/webhook/failurePolicy': value must be one of 'Ignore', 'Fail'"),
    ({"webhook": {"url": "http://127.0.0.1:9443/x"}}, "at '/webhook/url'"),
    ({"webhook": {"port": 70000}}, "at '/webhook/port': maximum"),
    ({"webhook": {"tls": {"secretName": "mine"}}}, "at '/webhook/tls/caBundle': minLength: got 0, want 1"),
    ({"operator": {"healthport": 8080}}, "at '/operator': additional properties 'healthport' not allowed"),
    ({"operator": {"watchNamespaces": ["Not_A_Namespace"]}}, "at '/operator/watchNamespaces/0'"),
    ({"image": {"pullPolicy": "Sometimes", "repository": "x"}}, "at '/image/pullPolicy'"),
    ({"nodeSelector": {"zone": 1}}, "at '/nodeSelector/zone': got number, want string"),
])
def test_bad_values_fail_install_and_lint_with_the_schema_message(values, message):
    for argv in (("template", "x", str(CHART)), ("lint", str(CHART))):
        proc = helm(*argv, values=values, check=False)
        assert proc.returncode != 0, f"helm {argv[0]} accepted {values}"
        assert message in proc.stdout + proc.stderr


def test_chart_crd_is_the_generated_one():
    assert (CHART / "crds" / crd.CRD_FILE).read_text() == crd.render()
    assert crd_cli.main(["--check"]) == 0


def test_operator_deploy_manifests_are_generated_from_the_chart(tmp_path):
    script = ROOT / "hack" / "gen-deploy.sh"
    ok = subprocess.run(["bash", str(script), "--check"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, f"operator/deploy/ is stale: run hack/gen-deploy.sh\n{ok.stderr}"
    stale = tmp_path / "deploy"
    shutil.copytree(ROOT / "operator" / "deploy", stale)
    (stale / "rbac.yaml").write_text((stale / "rbac.yaml").read_text().replace('"watch", "patch"', '"watch", "*"'))
    bad = subprocess.run(["bash", str(script), "--check", "--out", str(stale)], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 1 and "rbac.yaml differs from the chart" in bad.stderr
    assert "operator.yaml" not in bad.stderr
