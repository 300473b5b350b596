"""The operator's decisions without a cluster: injection, membership, warm-up plans
and their journal, condition merging, stats parsing, the published table."""
from __future__ import annotations

import copy
import dataclasses
from datetime import datetime, timedelta, timezone

import pytest
import yaml

from kvtier import control_api, policy
from kvtier.affinity import AffinityTable, TenantMove, plan_membership_change
from kvtier_operator import conditions, conflicts, hit_rate, injection, membership, names, publish, reconcile, warmup
from kvtier_operator.sidecar_client import FleetStats, parse_stats
from operator_cases import EXAMPLES_DIR


@pytest.fixture
def spec() -> policy.KVCachePolicySpec:
    return policy.parse_policy(yaml.safe_load((EXAMPLES_DIR / "llama-70b-interactive.yaml").read_text())).spec


def pod(labels=None, containers=None, **status) -> dict:
    return {"metadata": {"name": "p", "namespace": "ns", "labels": labels or {}},
            "spec": {"containers": containers or [{"name": "engine", "image": "e"}]}, "status": status}


IMAGE = injection.SidecarImage(image="kvtier:test")


def test_injection_adds_sidecar_volumes_env_and_mounts(spec):
    patch = injection.inject(pod({"app.kubernetes.io/name": "llama-70b-chat"}), "chat", spec, IMAGE)
    containers = {c["name"]: c for c in patch["spec"]["containers"]}
    sidecar = containers[names.SIDECAR_CONTAINER]
    assert sidecar["image"] == "kvtier:test"
    assert sidecar["command"] == ["kvtier-sidecar", "--config", "/etc/kvtier/sidecar.yaml"]
    env = {e["name"]: e for e in sidecar["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert "KVTIER_REDIS_URL" not in env  # a url is in the config; only a secretRef becomes env
    volumes = {v["name"]: v for v in patch["spec"]["volumes"]}
    assert volumes[names.CONFIG_VOLUME]["configMap"]["name"] == "chat-kvtier-sidecar"
    assert volumes[names.SHM_VOLUME]["emptyDir"] == {
        "medium": "Memory", "sizeLimit": str(500 * 2**30 + injection.SHM_HEADROOM_BYTES + injection.ENGINE_SHM_BYTES)}
    # The volume is the engine's /dev/shm too: vLLM will not start with less than its
    # broadcast ring (160 MiB) free beside a full arena (tests/nodes runs one).
    assert injection.ENGINE_SHM_BYTES >= 160 << 20
    engine_mounts = {m["mountPath"] for m in containers["engine"]["volumeMounts"]}
    assert engine_mounts == {names.SHM_MOUNT_PATH, names.RUN_MOUNT_PATH}
    assert patch["metadata"]["annotations"] == {names.INJECTED_ANNOTATION: "chat"}


def test_injection_mounts_the_policys_control_certificate_and_probes_over_https(spec):
    patch = injection.inject(pod(), "chat", spec, IMAGE)
    sidecar = {c["name"]: c for c in patch["spec"]["containers"]}[names.SIDECAR_CONTAINER]
    volumes = {v["name"]: v for v in patch["spec"]["volumes"]}
    assert volumes[names.CONTROL_TLS_VOLUME] == {"name": names.CONTROL_TLS_VOLUME,
                                                 "secret": {"secretName": "chat-kvtier-control-tls"}}
    mount = next(m for m in sidecar["volumeMounts"] if m["name"] == names.CONTROL_TLS_VOLUME)
    assert mount == {"name": names.CONTROL_TLS_VOLUME, "mountPath": names.CONTROL_TLS_MOUNT_PATH, "readOnly": True}
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env["KVTIER_CONTROL_TLS_CERT_FILE"] == f"{names.CONTROL_TLS_MOUNT_PATH}/tls.crt"
    assert env["KVTIER_CONTROL_TLS_KEY_FILE"] == f"{names.CONTROL_TLS_MOUNT_PATH}/tls.key"
    assert "KVTIER_CONTROL_TLS_PLAIN_HTTP" not in env
    assert sidecar["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    # Told to serve plain HTTP: no certificate, the choice said out loud, probed over HTTP.
    plain = injection.inject(pod(), "chat", spec, dataclasses.replace(IMAGE, tls=False))
    sidecar = {c["name"]: c for c in plain["spec"]["containers"]}[names.SIDECAR_CONTAINER]
    assert names.CONTROL_TLS_VOLUME not in {v["name"] for v in plain["spec"]["volumes"]}
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env["KVTIER_CONTROL_TLS_PLAIN_HTTP"] == "true" and "KVTIER_CONTROL_TLS_CERT_FILE" not in env
    assert sidecar["readinessProbe"]["httpGet"]["scheme"] == "HTTP"


def test_injection_is_idempotent_and_leaves_the_input_alone(spec):
    original = pod({"app": "x"})
    before = copy.deepcopy(original)
    patch = injection.inject(original, "chat", spec, IMAGE)
    assert original == before
    injected = {**original, "metadata": {**original["metadata"], **patch["metadata"]}, "spec": patch["spec"]}
    assert injection.inject(injected, "chat", spec, IMAGE) is None
    hand_made = pod(containers=[{"name": names.SIDECAR_CONTAINER, "image": "mine"}])
    assert injection.inject(hand_made, "chat", spec, IMAGE) is None


def test_redis_secret_becomes_env_not_config(spec):
    spec = spec.model_copy(update={"redis": policy.RedisSpec(secret_ref=policy.SecretKeyRef(name="r", key="u"))})
    patch = injection.inject(pod(), "chat", spec, IMAGE)
    env = {e["name"]: e for e in patch["spec"]["containers"][-1]["env"]}
    assert env["KVTIER_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "r", "key": "u"}


def test_only_selected_pods_are_chosen_and_opt_out_wins():
    sel = lambda **labels: policy.LabelSelector(match_labels=labels)  # noqa: E731
    policies = [conflicts.PolicyRef("b", "2026-01-01T00:00:00Z", sel(app="llm")),
                conflicts.PolicyRef("a", "2026-01-02T00:00:00Z", sel(app="llm", tier="gpu"))]
    assert injection.selecting_policy(pod({"app": "web"}), policies) is None
    assert injection.selecting_policy(pod({"app": "llm"}), policies) == "b"
    assert injection.selecting_policy(pod({"app": "llm", "tier": "gpu"}), policies) == "b"  # the older one
    assert injection.selecting_policy(pod({"app": "llm", names.OPT_OUT_LABEL: "false"}), policies) is None


def _ready(ip="10.0.0.1", ready="True", **meta) -> dict:
    body = pod({"app": "llm"}, podIP=ip, phase="Running", conditions=[{"type": "Ready", "status": ready}])
    body["metadata"].update(meta)
    return body


def test_members_are_ready_selected_pods_with_an_ip_not_being_deleted():
    sel = policy.LabelSelector(match_labels={"app": "llm"})
    views = [
        membership.pod_view({**_ready(), "metadata": {"name": "a", "labels": {"app": "llm"}}}),
        membership.pod_view({**_ready(ready="False"), "metadata": {"name": "b", "labels": {"app": "llm"}}}),
        membership.pod_view({**_ready(ip=None), "metadata": {"name": "c", "labels": {"app": "llm"}}}),
        membership.pod_view({**_ready(), "metadata": {"name": "d", "labels": {"app": "llm"},
                                                      "deletionTimestamp": "2025-01-01T00:00:00Z"}}),
        membership.pod_view({**_ready(), "metadata": {"name": "e", "labels": {"app": "web"}}}),
        membership.pod_view({**_ready(), "metadata": {"name": "f", "labels": {"app": "llm"},
                                                      "annotations": {membership.WEIGHT_ANNOTATION: "2"}}}),
    ]
    members = membership.members(views, sel)
    assert list(members) == ["a", "f"]
    assert membership.weights(members) == {"a": 1.0, "f": 2.0}


def _with_sidecar(state: dict, native: bool = True, last: dict | None = None, name: str = "a", **meta) -> dict:
    body = _ready(ready="False")
    status = {"name": names.SIDECAR_CONTAINER, "state": state, "ready": False, "restartCount": 3}
    if last:
        status["lastState"] = {"terminated": last}
    engine = {"name": "engine", "state": {"running": {}}, "ready": True}
    body["status"].update(initContainerStatuses=[status], containerStatuses=[engine]) if native else \
        body["status"].update(containerStatuses=[engine, status])
    body["metadata"].update(name=name, labels={"app": "llm"}, **meta)
    return body


def test_a_sidecar_that_cannot_run_is_named_with_kubelets_reason_native_or_plain():
    never = {"waiting": {"reason": "ErrImageNeverPull",
                         "message": 'Container image "ghcr.io/kvtier/kvtier:absent" is not present with pull policy of Never'}}
    for native in (True, False):
        view = membership.pod_view(_with_sidecar(never, native))
        assert view.sidecar_problem == ('ErrImageNeverPull: Container image "ghcr.io/kvtier/kvtier:absent" is not '
                                        'present with pull policy of Never')
    crash = membership.pod_view(_with_sidecar({"waiting": {"reason": "CrashLoopBackOff"}},
                                              last={"exitCode": 1, "reason": "Error"}))
    assert crash.sidecar_problem == "CrashLoopBackOff: last exit 1 (Error)"
    # Starting up, running, or a pod without the sidecar: nothing to report.
    for state in ({"waiting": {"reason": "ContainerCreating"}}, {"waiting": {"reason": "PodInitializing"}},
                  {"running": {"startedAt": "2026-12-06T00:00:00Z"}}):
        assert membership.pod_view(_with_sidecar(state)).sidecar_problem is None
    assert membership.pod_view(_ready()).sidecar_problem is None
    long = membership.pod_view(_with_sidecar({"waiting": {"reason": "ErrImagePull", "message": "x" * 5000}}))
    assert len(long.sidecar_problem) == membership.MAX_PROBLEM_CHARS

    sel = policy.LabelSelector(match_labels={"app": "llm"})
    views = [membership.pod_view(_with_sidecar(never, name="b")), crash,
             membership.pod_view(_with_sidecar(never, name="gone", deletionTimestamp="2026-01-01T00:00:00Z")),
             membership.pod_view({**_with_sidecar(never, name="other"), "metadata": {"name": "other",
                                                                                    "labels": {"app": "web"}}})]
    stuck = membership.stuck_sidecars(views, sel)
    assert list(stuck) == ["a", "b"]  # sorted; not the leaving pod, not another policy's

    events: list[tuple[str, str, str]] = []
    old = policy.KVCachePolicyStatus()
    obs = reconcile._sidecars_running_observation(stuck, old, lambda *e: events.append(e))
    assert (obs.type, obs.status, obs.reason) == ("SidecarsRunning", "False", "SidecarNotRunning")
    assert "2 selected pods' sidecar cannot run" in obs.message and "b: ErrImageNeverPull" in obs.message
    assert "a: CrashLoopBackOff: last exit 1" in obs.message and "sidecar.image" in obs.message
    assert [e[:2] for e in events] == [("Warning", "SidecarNotRunning")]
    # The same story again: no second event; fixed: True, no event.
    same = policy.KVCachePolicyStatus(conditions=[policy.Condition(
        type="SidecarsRunning", status="False", reason="SidecarNotRunning", message=obs.message,
        last_transition_time="2026-12-06T00:00:00Z")])
    reconcile._sidecars_running_observation(stuck, same, lambda *e: events.append(e))
    ok = reconcile._sidecars_running_observation({}, same, lambda *e: events.append(e))
    assert ok.status == "True" and len(events) == 1


def _members(*names_: str) -> dict[str, membership.Member]:
    return {n: membership.Member(membership.MemberName(n), f"10.0.0.{i + 1}", 1.0) for i, n in enumerate(names_)}


def test_warm_plan_targets_gained_homes_from_a_surviving_old_home():
    members = _members("a", "b", "d")
    moves = [
        TenantMove("t1", ("a", "b"), ("a", "d")),  # d gained; warm from a
        TenantMove("t2", ("c", "b"), ("b", "d")),  # c left; warm d from b
        TenantMove("t3", ("c", "e"), ("a", "d")),  # both old homes gone: cold
    ]
    plan = warmup.plan(moves, members, max_bytes_per_tenant=1 << 20)
    assert [(r.tenant, r.target, r.source) for r in plan.requests] == [("t1", "d", "a"), ("t2", "d", "b")]
    assert plan.cold_tenants == ("t3",)
    assert all(r.max_bytes == 1 << 20 for r in plan.requests)


def test_a_join_plans_warmups_for_exactly_the_tenants_that_gain_the_newcomer():
    tenants = [f"t{i}" for i in range(500)]
    old = AffinityTable(epoch=3, members={m: 1.0 for m in "abcd"}, homes=2)
    plan = plan_membership_change(old, {m: 1.0 for m in "abcde"}, tenants)
    members = _members(*"abcde")
    requests = warmup.plan(plan.moves, members, 1 << 20).requests
    gained = {t for t in tenants if "e" in plan.table.homes_for(t)}
    assert {r.tenant for r in requests} == gained and {r.target for r in requests} == {"e"}
    assert plan.table.epoch == 4 and abs(len(gained) / 500 - 2 / 5) < 0.08


def test_journal_resumes_only_for_the_same_epoch_and_members():
    members = _members("a", "b")
    digest = warmup.members_digest(members)
    reqs = [warmup.WarmTask("t1", "a", "b", 1), warmup.WarmTask("t2", "b", "a", 1)]
    journal = warmup.PendingEpoch(5, digest, {"t1@a"})
    restored = warmup.PendingEpoch.from_json(journal.to_json())
    assert restored.matches(5, digest) and restored.remaining(reqs) == reqs[1:]
    assert not restored.matches(6, digest)
    assert not restored.matches(5, warmup.members_digest(_members("a", "c")))
    assert warmup.PendingEpoch.from_json("{not json") is None


def test_conditions_keep_transition_time_unless_status_flips():
    t0 = datetime(2025, 1, 1, tzinfo=timezone.utc)
    first = conditions.merge([], [conditions.Observation("A", "True", "Ok")], 1, at=t0)
    same = conditions.merge(first, [conditions.Observation("A", "True", "Ok", "again")], 2, at=t0 + timedelta(1))
    assert same[0].last_transition_time == t0 and same[0].observed_generation == 2
    flipped = conditions.merge(same, [conditions.Observation("A", "False", "Bad")], 3, at=t0 + timedelta(2))
    assert flipped[0].last_transition_time == t0 + timedelta(2)
    kept = conditions.merge(flipped, [conditions.Observation("B", "True", "Ok")], 4, at=t0)
    assert [c.type for c in kept] == ["A", "B"] and kept[0].status == "False"


def _stats_body(lookups: int = 0, hits: int = 0, tenants: tuple[str, ...] = (), loaded: int = 0, prompt: int = 0,
                **fields) -> dict:
    """A `GET /cache/stats` answer as the sidecar sends it (the shared control-API model):
    `hits` of `lookups` offered, `loaded` of `prompt` tokens loaded by the engine."""
    row = control_api.TenantSummary(bytes=1, lookups=1, hits=0, warmed_bytes=0)
    engine = control_api.EngineLoads(loaded_tokens_by_tier={"dram": loaded - loaded // 4, "peer": loaded // 4},
                                     prompt_tokens=prompt)
    return control_api.dump(control_api.SidecarStats(lookups=lookups, hits=hits, engine=engine,
                                                     tenants={t: row for t in tenants}, **fields))


def test_fleet_stats_union_tenants_and_weight_the_loaded_hit_rate_by_prompt_tokens():
    fleet = FleetStats((
        parse_stats("a", _stats_body(100, 90, ("x", "y"), loaded=6000, prompt=10_000)),
        parse_stats("b", _stats_body(300, 30, ("y", "z"), loaded=2000, prompt=30_000)),
        parse_stats("c", _stats_body()),
    ))
    assert fleet.tenants == ["x", "y", "z"]
    assert fleet.hit_rate == pytest.approx(8000 / 40_000)


def test_the_fleet_hit_rate_is_what_engines_loaded_never_what_lookups_offered():
    """Every lookup hit (offered 100%), but the engines' own prefix caches held the
    prompts and they loaded a tenth of their tokens: the rate is the tenth. A sidecar
    whose engine reported nothing shows no rate, however many hits it offered."""
    offered_all = FleetStats((parse_stats("a", _stats_body(500, 500, loaded=3000, prompt=30_000)),))
    assert offered_all.hit_rate == pytest.approx(0.1)
    assert hit_rate.changed_fields(policy.KVCachePolicyStatus(), offered_all) == {"fleetHitRate": 0.1}
    silent = FleetStats((parse_stats("a", _stats_body(500, 500)),))
    assert silent.hit_rate is None and hit_rate.changed_fields(policy.KVCachePolicyStatus(), silent) is None


def test_hit_rate_refresh_writes_only_a_changed_rate():
    fleet = FleetStats((parse_stats("a", _stats_body(300, 290, ("x",), loaded=100, prompt=300)),))
    assert hit_rate.changed_fields(policy.KVCachePolicyStatus(), fleet) == {"fleetHitRate": 0.3333}
    same = policy.KVCachePolicyStatus(fleet_hit_rate=0.3333)
    assert hit_rate.changed_fields(same, fleet) is None
    assert hit_rate.changed_fields(policy.KVCachePolicyStatus(fleet_hit_rate=0.25), fleet) == {"fleetHitRate": 0.3333}
    no_lookups = FleetStats((parse_stats("a", _stats_body()),))
    assert hit_rate.changed_fields(same, no_lookups) is None
    assert hit_rate.changed_fields(policy.KVCachePolicyStatus(), FleetStats(())) is None


def test_stats_that_are_not_the_control_api_model_read_as_no_answer():
    assert parse_stats("a", {"lookups": "many"}) is None
    assert parse_stats("b", {"tenants": ["x", "y"]}) is None  # a list is not the tenant table
    assert parse_stats("c", _stats_body(5, 1, ("x",), draining=True)).draining is True


def test_published_table_round_trips_and_garbage_reads_as_none():
    table = AffinityTable(epoch=7, members={"a": 1.0, "b": 2.0}, homes=2)
    cm = publish.affinity_config_map("p", "ns", table, _members("a", "b"))
    assert publish.read_table(cm) == table
    assert cm["metadata"]["annotations"]["kvtier.io/epoch"] == "7"
    assert publish.read_table({"data": {names.AFFINITY_KEY: "{"}}) is None
    assert publish.read_table(None) is None


def test_verdicts_for_70b_tp4_are_the_design_numbers(spec):
    from kvtier_operator import economics

    tiers, observed = economics.verdicts(spec)
    by = {v.tier: v for v in tiers}
    assert by["dram"].break_even_gbps == pytest.approx(9.264, abs=1e-3)
    assert (by["dram"].ratio, by["peer"].ratio, by["nvme"].ratio) == pytest.approx((6.908, 2.699, 0.756), abs=1e-3)
    assert (by["dram"].verdict, by["peer"].verdict, by["nvme"].verdict) == ("serve", "serve", "shadow")
    nvme = next(o for o in observed if o.type == economics.NVME_CONDITION)
    assert (nvme.status, nvme.reason) == ("False", "SlowerThanRecompute")
    assert "46.8 us" in nvme.message and "35.4 us" in nvme.message


def test_batch_traffic_may_serve_from_nvme_even_when_slower(spec):
    from kvtier_operator import economics

    batch = spec.model_copy(update={"traffic_class": "batch", "tiers": policy.Tiers(nvme=policy.NvmeTier(mode="on"))})
    tiers, observed = economics.verdicts(batch)
    nvme = next(v for v in tiers if v.tier == "nvme")
    assert nvme.verdict == "serve" and nvme.ratio < 1
    cond = next(o for o in observed if o.type == economics.NVME_CONDITION)
    assert (cond.status, cond.reason) == ("True", "AllowedForBatch")


def test_shadow_mode_reports_the_measured_bandwidth(spec):
    from kvtier_operator import economics

    tiers, _ = economics.verdicts(spec, measured_nvme_gbps=3.5)
    nvme = next(v for v in tiers if v.tier == "nvme")
    assert nvme.measured_gbps == 3.5 and nvme.bandwidth_gbps == 3.5 and nvme.verdict == "shadow"


def test_sidecar_config_carries_the_key_root_and_shape(spec):
    from kvtier.sidecar_config import from_mapping, parse_text
    from kvtier_operator import sidecar_render

    rendered = sidecar_render.render(spec)
    cfg = from_mapping(parse_text(rendered.text))  # the sidecar's own loader accepts it
    assert cfg.model.weights_version == spec.model.weights_version
    assert (cfg.model.layers, cfg.model.kv_heads, cfg.model.head_dim, cfg.model.dtype_bytes) == (80, 8, 128, 2)
    assert cfg.dram_capacity_bytes == 500 * 2**30 and cfg.redis_url == spec.redis.url
    assert sidecar_render.render(spec).digest == rendered.digest  # deterministic


def test_operator_cli_rejects_half_a_certificate_with_exit_2(capsys):
    from kvtier_operator.main import main

    assert main(["--webhook-cert", "c.pem"]) == 2
    assert "--webhook-key" in capsys.readouterr().err
    assert main(["--webhook-cert", "c.pem", "--webhook-key", "k.pem"]) == 2


def test_fleet_nvme_figure_is_the_median_of_the_members_measurements():
    def probe(gbps: float | None, error: str | None = None) -> control_api.NvmeReport:
        return control_api.NvmeReport(mode="shadow", path="/nvme", measured_gbps=gbps, error=error)

    stats = [parse_stats(m, _stats_body(nvme=probe(g))) for m, g in (("a", 1.0), ("b", 9.0), ("c", 2.0))]
    assert FleetStats(tuple(stats)).nvme_gbps == 2.0
    assert FleetStats(tuple(stats[:2])).nvme_gbps == 5.0
    unmeasured = parse_stats("d", _stats_body(nvme=probe(None, "OSError")))
    assert unmeasured.nvme_gbps is None and FleetStats((unmeasured,)).nvme_gbps is None
    assert parse_stats("e", _stats_body(tenants=("y", "x"))).tenants == ("x", "y")


def test_sidecar_config_renders_peer_switch_thrash_ratio_and_nvme(spec):
    from kvtier.sidecar_config import from_mapping, parse_text
    from kvtier_operator import sidecar_render

    changed = spec.model_copy(deep=True)
    changed.tiers.peer.enabled = False
    changed.tiers.nvme.mode = "shadow"
    changed.tiers.nvme.path = "/mnt/nvme0"
    changed.admission.thrash_ratio = 0.7
    cfg = from_mapping(parse_text(sidecar_render.render(changed).text), {})
    assert cfg.peer_enabled is False and cfg.thrash_ratio == 0.7
    assert (cfg.nvme.mode, cfg.nvme.path) == ("shadow", "/mnt/nvme0")
    assert sidecar_render.render(changed).digest != sidecar_render.render(spec).digest


def test_deepseek_v3_preset_renders_the_mla_latent_size(spec):
    from kvtier_operator import sidecar_render

    ds = spec.model_copy(deep=True)
    ds.model.preset, ds.model.shape, ds.model.kv_dtype = "deepseek-v3", None, "bf16"
    cfg = sidecar_render.sidecar_config(ds)
    assert cfg.model.kv_bytes_per_token() == 70_272  # (512 + 64) x 61 x 2 B, not K and V
    assert cfg.block_bytes == 70_272 * 16


def test_injection_mounts_the_nvme_host_path_only_when_nvme_is_used(spec):
    off, shadow = spec.model_copy(deep=True), spec.model_copy(deep=True)
    off.tiers.nvme.mode, shadow.tiers.nvme.mode = "off", "shadow"
    assert names.NVME_VOLUME not in {v["name"] for v in injection.inject(pod(), "p", off, IMAGE)["spec"]["volumes"]}
    patch = injection.inject(pod(), "p", shadow, IMAGE)
    volumes = {v["name"]: v for v in patch["spec"]["volumes"]}
    assert volumes[names.NVME_VOLUME]["hostPath"] == {"path": "/var/lib/kvtier/nvme", "type": "DirectoryOrCreate"}
    sidecar = next(c for c in patch["spec"]["containers"] if c["name"] == names.SIDECAR_CONTAINER)
    assert {"name": names.NVME_VOLUME, "mountPath": "/var/lib/kvtier/nvme"} in sidecar["volumeMounts"]


def test_warm_up_refs_name_the_epoch_and_member_set():
    a, b = warmup.PendingEpoch(5, "abc"), warmup.PendingEpoch(6, "abc")
    assert a.ref_prefix != b.ref_prefix != warmup.PendingEpoch(5, "abd").ref_prefix
    assert warmup.PendingEpoch.from_json(a.to_json()).ref_prefix == a.ref_prefix


def test_mla_shape_kv_elements_must_be_one_or_two_planes():
    ok = policy.ModelShape(layers=61, kv_heads=1, head_dim=576, params=671e9, kv_elements_per_token=61 * 576)
    assert ok.kv_elements_per_token == 35_136
    with pytest.raises(ValueError, match="kvElementsPerToken"):
        policy.ModelShape(layers=61, kv_heads=1, head_dim=576, params=671e9, kv_elements_per_token=35_000)
