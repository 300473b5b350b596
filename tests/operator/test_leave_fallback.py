"""A leaver that stops answering before its tenants are warmed: the operator's warm-up
falls back to a surviving old home, and the epoch is published only after that
finished. Real sidecar processes on their default ports (as in a pod), a recording
stand-in for the Kubernetes API (the rest of the reconcile is covered end to end)."""
from __future__ import annotations

import asyncio
import json

import pytest

from kvtier import policy
from kvtier import sidecar_config as cfgmod
from kvtier.affinity import AffinityTable, TenantMove
from kvtier_operator import membership, names, reconcile, sidecar_render
from kvtier_operator.sidecar_client import ControlTls, SidecarClient
from kvtier_testenv.fleet import SidecarHandle, fleet_namespace, fleet_secret, fleet_tls
from sidecar_fleet import PodSidecar, tiny_policy

# Loopback addresses no other test uses: the sidecars bind the pod ports 8081/8082.
IPS = {"keep": "127.3.0.2", "new": "127.3.0.3", "gone": "127.3.0.4"}  # nothing listens on "gone"


class RecordingKube:
    """What `_warm_then_publish` writes, in order."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, object]] = []

    async def patch_annotations(self, namespace, name, annotations) -> None:
        self.writes.append(("annotations", annotations[names.PENDING_EPOCH_ANNOTATION]))

    async def apply_config_map(self, body) -> bool:
        self.writes.append(("configmap", body["metadata"]["name"]))
        return True


class Plan:
    def __init__(self, moves):
        self.moves = moves


@pytest.fixture
def sidecars(tmp_path):
    spec = policy.parse_policy(tiny_policy("fallback", "fallback")).spec
    base = cfgmod.parse_text(sidecar_render.render(spec).text)
    handles = {}
    try:
        for name in ("keep", "new"):
            # No API server to review tokens here: the control API is open, as the
            # webhook makes it when the operator runs with --sidecar-auth=open.
            config = {**base, "pod_name": name, "pod_ip": IPS[name], "log_level": "WARNING",
                      "engine_socket": str(tmp_path / f"{name}.sock"), "control_auth": {"mode": "open"},
                      "peer_secret_file": fleet_secret(tmp_path), "control_tls": fleet_tls(tmp_path).config()}
            handles[name] = SidecarHandle(name, IPS[name], tmp_path, config).start()
        yield spec, handles, tmp_path
    finally:
        for h in handles.values():
            h.kill()


def test_warm_up_falls_back_to_a_surviving_old_home_when_the_leaver_does_not_answer(sidecars):
    spec, handles, workdir = sidecars
    keep, new = (PodSidecar(n, IPS[n], handles[n].socket, handles[n].control) for n in ("keep", "new"))
    keep.seed("moved", 2)
    # The fleet's certificate names policy "fleet" of the fleet's namespace.
    ns = fleet_namespace(workdir)
    members = {n: membership.Member(membership.MemberName(n), IPS[n], 1.0, ns, "fleet") for n in ("keep", "new")}
    leavers = {"gone": membership.Member(membership.MemberName("gone"), IPS["gone"], 1.0, ns, "fleet")}
    table = AffinityTable(epoch=8, members={"keep": 1.0, "new": 1.0}, homes=2)
    body = {"metadata": {"name": "fallback", "namespace": "ns", "uid": "u-1", "annotations": {}},
            "apiVersion": "kvtier.io/v1alpha1", "kind": "KVCachePolicy"}
    kube = RecordingKube()

    async def run() -> None:
        client = SidecarClient.create(tls=ControlTls.from_ca(fleet_tls(workdir).ca_pem))
        try:
            await reconcile._warm_then_publish(kube, client, body, spec, members,
                                               Plan([TenantMove("moved", ("gone", "keep"), ("keep", "new"))]),
                                               table, leavers)
        finally:
            await client.close()

    asyncio.run(run())
    jobs = new.warm_jobs()
    by_source = {j["from_peer"]: j for j in jobs}
    assert set(by_source) == {f"{IPS['gone']}:8082", f"{IPS['keep']}:8082"}, jobs
    assert by_source[f"{IPS['gone']}:8082"]["state"] == "failed"
    assert by_source[f"{IPS['keep']}:8082"]["state"] == "done"
    assert new.holds("moved", 2)
    kinds = [k for k, _ in kube.writes]
    assert kinds[-2:] == ["configmap", "annotations"] and kube.writes[-1][1] is None  # published, journal cleared
    journals = [json.loads(v) for k, v in kube.writes if k == "annotations" and v]
    assert journals and "moved@new" in journals[-1]["done"]


def test_a_deleted_pods_sidecar_not_draining_yet_is_a_leaver_and_a_live_unready_one_is_not(sidecars):
    """A native sidecar is signalled only once its engine has exited: while the pod is
    being deleted and the engine shuts down, the sidecar answers without draining. It
    still holds the pod's tenants, so it is a leaver (a warm-up source); the same answer
    from a pod that is merely not Ready, or from a deleted pod whose sidecar is silent,
    is not."""
    spec, handles, workdir = sidecars
    ns = fleet_namespace(workdir)
    candidates = {n: membership.Member(membership.MemberName(n), IPS[n], 1.0, ns, "fleet")
                  for n in ("keep", "new", "gone")}

    async def run(terminating):
        client = SidecarClient.create(tls=ControlTls.from_ca(fleet_tls(workdir).ca_pem))
        try:
            return await client.draining(candidates, terminating)
        finally:
            await client.close()

    leavers, stats = asyncio.run(run({"keep", "gone"}))
    assert list(leavers) == ["keep"]  # "gone" is silent: no source, whatever its pod
    assert [s.member for s in stats] == ["keep"] and not stats[0].draining
    leavers, stats = asyncio.run(run(()))
    assert leavers == {} and stats == []
