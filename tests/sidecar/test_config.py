import json

import pytest
from pydantic import ValidationError

from kvtier import sidecar_config as sc


def test_defaults_are_valid_and_env_from_downward_api_wins():
    cfg = sc.from_mapping({"pod_name": "file-name"}, {"POD_NAME": "web-0", "POD_NAMESPACE": "serving",
                                                     "POD_IP": "10.1.2.3", "KVTIER_WEIGHTS_VERSION": "sha256:abc"})
    assert (cfg.pod_name, cfg.pod_namespace, cfg.pod_ip) == ("web-0", "serving", "10.1.2.3")
    assert cfg.model.weights_version == "sha256:abc"
    assert cfg.block_bytes == cfg.model.kv_bytes_per_token() * 16


def test_70b_gqa8_fp16_kv_is_320_kib_per_token():
    shape = sc.ServedModel(layers=80, kv_heads=8, head_dim=128, dtype_bytes=2)
    assert shape.kv_bytes_per_token() == 327_680


def test_shm_names_differ_per_pod_and_namespace():
    a = sc.from_mapping({"pod_name": "a", "pod_namespace": "x"}, {})
    b = sc.from_mapping({"pod_name": "b", "pod_namespace": "x"}, {})
    c = sc.from_mapping({"pod_name": "a", "pod_namespace": "y"}, {})
    assert len({a.shm_name, b.shm_name, c.shm_name}) == 3
    assert all(len(n.shm_name) <= 30 for n in (a, b, c))


@pytest.mark.parametrize("bad", [
    {"unknown_field": 1},
    {"dram_capacity_bytes": 10},
    {"log_level": "LOUD"},
    {"pod_name": "has space"},
    {"platform_prefixes": [[-1]]},
    {"peer_port": 70000},
])
def test_bad_config_is_a_validation_error_naming_the_field(bad):
    with pytest.raises(ValidationError) as info:
        sc.from_mapping(bad, {})
    assert list(bad)[0] in str(info.value)


def test_file_round_trip_yaml_and_json(tmp_path):
    cfg = sc.from_mapping({"redis_url": "redis://r:6379/0", "platform_prefixes": [[1, 2, 3]]}, {})
    path = tmp_path / "c.yaml"
    path.write_text(sc.dump_yaml(cfg))
    again = sc.load(path, env={})
    assert again.redis_url == cfg.redis_url and again.platform_prefixes == [[1, 2, 3]]
    path.write_text(json.dumps({"block_size": 32}))
    assert sc.load(path, env={}).block_size == 32


def test_reload_diff_separates_live_fields_from_restart_fields():
    old = sc.from_mapping({}, {})
    new = sc.from_mapping({"log_level": "DEBUG", "dram_capacity_bytes": 2 << 30, "peer_timeout_s": 0.5}, {})
    live, restart = sc.reload_diff(old, new)
    assert live == {"log_level": "DEBUG", "peer_timeout_s": 0.5}
    assert restart == ["dram_capacity_bytes"]
