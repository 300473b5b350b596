"""The node agent's pure helpers: what kubelet would hand a container."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvtier_testenv import podenv
from kvtier_testenv.podenv import PodSpecError, expand_vars, field_ref, rewrite_paths
from kvtier_testenv.podvolumes import write_atomic_volume

POD = {
    "metadata": {"name": "web-0", "namespace": "t-1", "uid": "u-1",
                 "labels": {"app": "web", "kvtier.dev/weights": "v7"}, "annotations": {"a": "b"}},
    "spec": {"nodeName": "n1", "serviceAccountName": "sa"},
    "status": {"podIP": "127.1.0.9", "podIPs": [{"ip": "127.1.0.9"}], "hostIP": "127.0.0.1"},
}


class _Lookup:
    def __init__(self, objects: dict[tuple[str, str], dict[str, str]]) -> None:
        self.objects = objects

    def data(self, kind: str, name: str) -> dict[str, str] | None:
        return self.objects.get((kind, name))


def test_expand_vars_replaces_defined_keeps_undefined_and_unescapes_dollars() -> None:
    env = {"A": "1", "B": "x"}
    assert expand_vars("$(A)-$(B)-$(C)-$$(A)", env) == "1-x-$(C)-$(A)"


def test_field_ref_reads_the_downward_api_paths_kubelet_supports() -> None:
    assert field_ref(POD, "metadata.name") == "web-0"
    assert field_ref(POD, "metadata.namespace") == "t-1"
    assert field_ref(POD, "metadata.uid") == "u-1"
    assert field_ref(POD, "metadata.labels['kvtier.dev/weights']") == "v7"
    assert field_ref(POD, "metadata.annotations['a']") == "b"
    assert field_ref(POD, "status.podIP") == "127.1.0.9"
    assert field_ref(POD, "spec.nodeName") == "n1"
    with pytest.raises(PodSpecError, match="unsupported downward API"):
        field_ref(POD, "spec.containers")


def test_resolve_env_orders_envfrom_then_env_and_expands_earlier_names() -> None:
    container = {
        "envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "CFG_"}],
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "GREETING", "value": "hi $(POD_NAME) $(CFG_mode)"},
            {"name": "WEIGHTS", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "weights"}}},
            {"name": "OPT", "valueFrom": {"configMapKeyRef": {"name": "nope", "key": "k", "optional": True}}},
        ],
    }
    lookup = _Lookup({("ConfigMap", "cfg"): {"mode": "fast", "weights": "sha256:ab"}})
    env = podenv.resolve_env(container, POD, lookup)
    assert env == {"CFG_mode": "fast", "CFG_weights": "sha256:ab", "POD_NAME": "web-0",
                   "GREETING": "hi web-0 fast", "WEIGHTS": "sha256:ab"}


def test_resolve_env_missing_required_configmap_key_is_a_clear_error() -> None:
    container = {"env": [{"name": "W", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "weights"}}}]}
    with pytest.raises(PodSpecError, match="ConfigMap 'cfg' key 'weights' not found"):
        podenv.resolve_env(container, POD, _Lookup({("ConfigMap", "cfg"): {}}))


def test_rewrite_paths_replaces_whole_mount_paths_longest_first() -> None:
    mounts = {"/etc/kvtier": Path("/tmp/p/cfg"), "/etc/kvtier/tls": Path("/tmp/p/tls")}
    assert rewrite_paths("--config=/etc/kvtier/sidecar.yaml", mounts) == "--config=/tmp/p/cfg/sidecar.yaml"
    assert rewrite_paths("/etc/kvtier/tls/ca.crt", mounts) == "/tmp/p/tls/ca.crt"
    assert rewrite_paths("/etc/kvtier", mounts) == "/tmp/p/cfg"
    # A longer sibling name is a different path and stays as written.
    assert rewrite_paths("/etc/kvtier-other/x", mounts) == "/etc/kvtier-other/x"


def test_atomic_volume_swaps_payload_and_drops_removed_keys(tmp_path: Path) -> None:
    target = tmp_path / "vol"
    write_atomic_volume(target, {"a.yaml": b"one", "b": b"bee"})
    assert (target / "a.yaml").read_text() == "one"
    assert (target / "a.yaml").is_symlink() and (target / "..data").is_symlink()
    first = (target / "..data").resolve()
    write_atomic_volume(target, {"a.yaml": b"two"})
    assert (target / "a.yaml").read_text() == "two"
    assert not (target / "b").exists()
    assert not first.exists(), "the previous payload directory is removed after the swap"
    assert sorted(p.name for p in target.iterdir() if not p.name.startswith("..")) == ["a.yaml"]


def test_pod_ips_are_unique_loopback_addresses() -> None:
    ips = [podenv.next_pod_ip() for _ in range(600)]
    assert len(set(ips)) == 600
    assert all(ip.startswith(f"127.{podenv._POD_NET}.") and not ip.endswith(".0") and not ip.endswith(".255")
               for ip in ips)
    assert not any(ip.startswith("127.0.") for ip in ips)  # clear of the test servers' 127.0.0.x
