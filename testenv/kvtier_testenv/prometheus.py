"""A real Prometheus and Alertmanager on free loopback ports, for tests and the demo.

Prometheus is built by hack/prometheus.sh from its Go module with Kubernetes service
discovery (Debian's package leaves that out); `promtool` and Alertmanager are Debian's
`prometheus` and `prometheus-alertmanager` packages. scripts/setup.sh installs all
three. Where systemd runs, the packages start system instances on 9090 and 9093; these
helpers never touch them: each server here gets its own port, its own data directory
and its own configuration.

Prometheus finds what to scrape as it would in a cluster: `kubernetes_sd_configs` (pod
role) against the test's kube-apiserver, authenticated by a client certificate whose
user may only get/list/watch pods (`grant_discovery`), keeping the pods the webhook
injected (annotation `kvtier.io/injected-by`) on their `kvtier-http` port and labelling
them with namespace, pod and policy. The node agent gives pods loopback IPs, so the
discovered addresses are reachable from here. The operator under test runs in-process,
not in a pod: it is a static target (`operator_targets`).

The alert rules are the chart's own, rendered by the real `helm template` with values
short enough for tests (`chart_rules`).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from kvtier import control_tls
from kvtier_testenv import binaries, processes
from kvtier_testenv.ports import HOST, free_port
from kvtier_testenv.polling import wait_for

PROMETHEUS_ENV = "KVTIER_PROMETHEUS"
ALERTMANAGER_ENV = "KVTIER_ALERTMANAGER"
PROMTOOL_ENV = "KVTIER_PROMTOOL"
# A cold start on a loaded 2-core machine (TSDB creation, rule loading) takes seconds.
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
# Tests judge rollouts in seconds: scrape and evaluate every second.
SCRAPE_INTERVAL = "1s"
# Who Prometheus authenticates as against the apiserver (pods: get/list/watch only).
DISCOVERY_USER = "kvtier-prometheus"
DISCOVERY_ROLE = "kvtier-prometheus-discovery"
CHART = binaries.REPO_ROOT / "charts" / "kvtier"
RULES_KEY = "kvtier-rules.yaml"
# Chart values for tests: rates over a few scrapes, alerts after two evaluations.
TEST_RULE_VALUES = {"window": "10s", "for": "2s", "minLookupsPerSecond": 0.05, "rolloutStalledAfterSeconds": 600}


def _binary(env: str, *names: str) -> str:
    """$env, else the first of `names` on PATH or in /usr/bin; RuntimeError with the fix."""
    for candidate in (os.environ.get(env), *(shutil.which(n) for n in names), *(f"/usr/bin/{n}" for n in names)):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise RuntimeError(f"{names[0]} not found: run scripts/setup.sh (apt-get install prometheus "
                       f"prometheus-alertmanager) or point {env} at the binary")


PROMETHEUS_BUILD = binaries.REPO_ROOT / "hack" / "prometheus.sh"


def prometheus_binary() -> str:
    """The Prometheus built by hack/prometheus.sh (with Kubernetes discovery), or
    $KVTIER_PROMETHEUS; Debian's /usr/bin/prometheus cannot discover pods."""
    explicit = os.environ.get(PROMETHEUS_ENV)
    if explicit:
        return _binary(PROMETHEUS_ENV, "prometheus")
    path = subprocess.run(["bash", str(PROMETHEUS_BUILD), "--print-path"], capture_output=True, text=True,
                          timeout=60).stdout.strip()
    if not path or not os.access(path, os.X_OK):
        raise RuntimeError(f"Prometheus with Kubernetes discovery not built at {path or '?'}: run scripts/setup.sh "
                           f"(or hack/prometheus.sh), or point {PROMETHEUS_ENV} at such a binary")
    return path


def alertmanager_binary() -> str:
    return _binary(ALERTMANAGER_ENV, "prometheus-alertmanager", "alertmanager")


def promtool_binary() -> str:
    return _binary(PROMTOOL_ENV, "promtool")


# --- configuration (pure) -------------------------------------------------------------


def sidecar_scrape_config(kubeconfig: Path | str, namespaces: list[str] | None = None,
                          ca_file: Path | str | None = None) -> dict[str, Any]:
    """The scrape job for injected sidecars: pod discovery, kept by the webhook's
    annotation and the sidecar's named port, labelled namespace/pod/policy (the same
    relabelling as the chart's PodMonitor). With `ca_file` (the operator's control CA),
    over HTTPS verifying the name every sidecar certificate carries for scrapers, as
    the PodMonitor does."""
    sd: dict[str, Any] = {"role": "pod", "kubeconfig_file": str(kubeconfig)}
    if namespaces:
        sd["namespaces"] = {"names": list(namespaces)}
    tls: dict[str, Any] = {} if ca_file is None else {
        "scheme": "https", "tls_config": {"ca_file": str(ca_file), "server_name": control_tls.SCRAPE_SERVER_NAME}}
    return {
        "job_name": "kvtier-sidecars",
        **tls,
        "scrape_interval": SCRAPE_INTERVAL,
        "kubernetes_sd_configs": [sd],
        "relabel_configs": [
            {"source_labels": ["__meta_kubernetes_pod_annotation_kvtier_io_injected_by"], "regex": "(.+)",
             "action": "keep"},
            {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": "kvtier-http", "action": "keep"},
            {"source_labels": ["__meta_kubernetes_pod_annotation_kvtier_io_injected_by"], "target_label": "policy"},
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        ],
    }


def operator_pod_scrape_config(kubeconfig: Path | str, namespaces: list[str]) -> dict[str, Any]:
    """The operator's pod (the chart's Deployment) on its `metrics` port, found through
    the apiserver; honor_labels keeps the policy's namespace on the rollout series."""
    return {
        "job_name": "kvtier-operator",
        "scrape_interval": SCRAPE_INTERVAL,
        "honor_labels": True,
        "kubernetes_sd_configs": [{"role": "pod", "kubeconfig_file": str(kubeconfig),
                                   "namespaces": {"names": list(namespaces)}}],
        "relabel_configs": [
            {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": "metrics", "action": "keep"},
        ],
    }


def operator_scrape_config(targets: list[str]) -> dict[str, Any]:
    return {"job_name": "kvtier-operator", "scrape_interval": SCRAPE_INTERVAL, "honor_labels": True,
            "static_configs": [{"targets": list(targets)}]}


def prometheus_config(scrape_configs: list[dict[str, Any]], rule_files: list[str],
                      alertmanager: str | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "rule_files": rule_files,
        "scrape_configs": scrape_configs,
    }
    if alertmanager:
        cfg["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
    return cfg


def chart_rules(values: dict[str, Any] | None = None) -> str:
    """The chart's rules file, rendered by the real `helm template` with `values`
    under monitoring.rules (None: the chart's defaults)."""
    rules = dict(values or {})
    with tempfile.TemporaryDirectory(prefix="kvtier-rules-") as home:
        vf = Path(home) / "values.json"
        vf.write_text(json.dumps({"monitoring": {"rules": rules}}))
        env = {**os.environ, "HELM_CACHE_HOME": f"{home}/c", "HELM_CONFIG_HOME": f"{home}/f",
               "HELM_DATA_HOME": f"{home}/d"}
        out = subprocess.run([str(binaries.find().helm), "template", "kvtier", str(CHART), "--values", str(vf),
                              "--show-only", "templates/monitoring.yaml"],
                             capture_output=True, text=True, env=env, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"helm template failed: {out.stderr.strip()}")
    [cm] = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "ConfigMap" and RULES_KEY in d["data"]]
    return cm["data"][RULES_KEY]


# --- RBAC for discovery ------------------------------------------------------------------


def grant_discovery(control_plane, kubectl) -> Path:
    """A ClusterRole that may only read pods, bound to DISCOVERY_USER; its kubeconfig."""
    kubectl.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                   "metadata": {"name": DISCOVERY_ROLE},
                   "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]})
    kubectl.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                   "metadata": {"name": DISCOVERY_ROLE},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": DISCOVERY_ROLE},
                   "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": DISCOVERY_USER}]})
    return control_plane.kubeconfig_for_user(DISCOVERY_USER)


# --- processes -------------------------------------------------------------------------


def _get_json(url: str, timeout_s: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


class _Server:
    """A child process on a fixed port of `host` (loopback unless a test's pods must
    reach it: then the node's bridge address) that can be SIGKILLed and restarted."""

    name = "server"
    ready_path = "/-/ready"

    def __init__(self, workdir: Path | None = None, host: str = HOST) -> None:
        self.dir = Path(workdir or tempfile.mkdtemp(prefix=f"kvtier-{self.name}-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.port = free_port(host)
        self.proc: subprocess.Popen | None = None
        self.log_path = self.dir / f"{self.name}.log"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def argv(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> "_Server":
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, cwd=self.dir,
                                     start_new_session=True)
        log.close()
        try:
            wait_for(f"{self.name} ready on {self.url}", self._up, timeout_s=READY_TIMEOUT_S, interval_s=0.2)
        except TimeoutError as exc:
            raise RuntimeError(f"{exc}\n{self.log_tail()}") from None
        return self

    def _up(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
        return _ready(self.url + self.ready_path)

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-flight, as a crashed pod would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(STOP_TIMEOUT_S)
        self.proc = None

    def stop(self) -> None:
        processes.stop(self.proc, STOP_TIMEOUT_S)
        self.proc = None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return f"(no log at {self.log_path})"


class Alertmanager(_Server):
    name = "alertmanager"

    def argv(self) -> list[str]:
        cfg = self.dir / "alertmanager.yml"
        cfg.write_text(yaml.safe_dump({
            "route": {"receiver": "null", "group_wait": "1s", "group_interval": "1s", "repeat_interval": "1h"},
            "receivers": [{"name": "null"}],
        }))
        return [alertmanager_binary(), f"--config.file={cfg}", f"--storage.path={self.dir / 'data'}",
                f"--web.listen-address={self.address}", "--cluster.listen-address=",
                "--log.level=warn"]

    def alerts(self) -> list[dict[str, Any]]:
        return _get_json(self.url + "/api/v2/alerts?active=true")


class Prometheus(_Server):
    """`configure` first (scrape jobs, rules, Alertmanager), then start; a restart keeps
    the port, the data and the configuration."""

    name = "prometheus"

    def configure(self, scrape_configs: list[dict[str, Any]], rules: str | None = None,
                  alertmanager: str | None = None) -> "Prometheus":
        rule_files = []
        if rules is not None:
            (self.dir / RULES_KEY).write_text(rules)
            rule_files.append(str(self.dir / RULES_KEY))
        (self.dir / "prometheus.yml").write_text(
            yaml.safe_dump(prometheus_config(scrape_configs, rule_files, alertmanager), sort_keys=False))
        return self

    def argv(self) -> list[str]:
        return [prometheus_binary(), f"--config.file={self.dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.dir / 'data'}", f"--web.listen-address={self.address}",
                "--storage.tsdb.retention.time=2h", "--log.level=warn"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's vector (a scalar comes back as one series without labels)."""
        body = _get_json(f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}")
        data = body["data"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def targets(self) -> list[dict[str, Any]]:
        return _get_json(self.url + "/api/v1/targets?state=active")["data"]["activeTargets"]

    def alerts(self) -> list[dict[str, Any]]:
        return _get_json(self.url + "/api/v1/alerts")["data"]["alerts"]

    def fired(self, alert: str, labels: dict[str, str], within: str = "15m") -> list[dict[str, Any]]:
        """The alert's series that were firing at some point in the last `within`, from
        Prometheus' own ALERTS series (an alert resolved since still counts)."""
        matchers = ", ".join([f'alertname="{alert}"', 'alertstate="firing"',
                              *(f'{k}="{v}"' for k, v in sorted(labels.items()))])
        return self.query(f"max_over_time(ALERTS{{{matchers}}}[{within}])")

    def up_targets(self, job: str) -> dict[str, dict[str, str]]:
        """{scrape URL: labels} of the job's targets whose last scrape succeeded."""
        return {t["scrapeUrl"]: t["labels"] for t in self.targets()
                if t["labels"].get("job") == job and t["health"] == "up"}


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool_binary(), *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def wait_for_series(prom: Prometheus, expr: str, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    return wait_for(f"series for {expr}", lambda: prom.query(expr), timeout_s=timeout_s, interval_s=0.5)
