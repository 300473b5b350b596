"""kopf handlers: thin. Parse, call `reconcile`/`injection`, write, raise kopf errors.

    startup              settings (finalizer, annotation storage, watch timeouts,
                         webhook server), the control CA, clients into memo
    policies_by_namespace, pods_by_namespace
                         indexes: what the webhook and the membership loop read (the
                         webhook reads the apiserver until they are loaded:
                         admission_policies.py)
    spec_changed         create / update(spec) / resume: sidecar ConfigMap, verdicts
    membership_loop      daemon per policy: members -> epoch (woken by pod events)
    pod_changed          pod events wake the loops of their namespace's policies
    inject_sidecar       mutating admission webhook for pod CREATE
    policy_deleted       finalizer: a rollout in flight rolled back (rollout_teardown.py), then
                         the Redis key and ConfigMaps
    hit_rate_tick        timer per policy: status.fleetHitRate under steady traffic
    control_cert_tick    timer per policy: its control API certificate renewed when due
                         (control_certs.py; issued first by spec_changed)
    rollout_tick         timer per policy with a workloadRef (rollout_handlers.py)
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import kopf
from kubernetes.client.rest import ApiException

from kvtier import policy

from kvtier_operator import (admission_policies, conflicts, control_certs, hit_rate, injection, metrics, names,
                             publish, reconcile, rollout_teardown, rollout_warmup_io, sidecar_render, webhook_gate)
from kvtier_operator.kube import Kube
from kvtier_operator.membership import PodView, pod_view
from kvtier_operator.options import (
    WATCH_CLIENT_TIMEOUT_S, WATCH_CONNECT_TIMEOUT_S, WATCH_SERVER_TIMEOUT_S, OperatorOptions,
)
from kvtier_operator.registry import PolicyKey, PolicyRegistry
from kvtier_operator.sidecar_client import ControlTls, PodTokens, SidecarClient

POLICY = (policy.GROUP, policy.VERSION, policy.PLURAL)
# While Redis lags the published table: short enough that routers reading Redis catch
# up within seconds of its return, long enough not to hammer a Redis that is down.
REDIS_RETRY_S = 2.0
log = logging.getLogger("kvtier.operator")


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    options = OperatorOptions.from_env()
    settings.persistence.finalizer = names.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=names.PREFIX, key="last-handled-configuration")
    settings.watching.server_timeout = WATCH_SERVER_TIMEOUT_S
    settings.watching.client_timeout = WATCH_CLIENT_TIMEOUT_S
    settings.watching.connect_timeout = WATCH_CONNECT_TIMEOUT_S
    # Least privilege: no cluster-wide CRD/namespace watching, no peering objects.
    settings.scanning.disabled = True
    settings.peering.standalone = True
    # kopf's own INFO chatter stays in the log; Events are the ones we post on purpose.
    settings.posting.level = logging.WARNING
    if options.webhook_host:
        settings.admission.server = kopf.WebhookServer(
            addr=options.webhook_host, port=options.webhook_port, host=options.webhook_host,
            certfile=options.webhook_cert, pkeyfile=options.webhook_key,
        )
    memo.options = options
    memo.kube = Kube.from_environment()
    memo.control_certs = await _control_certs(memo.kube, options)
    memo.native_sidecars = options.native_sidecars == "auto" and await _native_sidecars(memo.kube)
    memo.sidecars = SidecarClient.create(
        options.warms_per_target, options.sidecar_token_file,
        _pod_tokens(memo.kube, options.sidecar_token_service_account),
        ControlTls.from_ca(memo.control_certs.ca.cert_pem) if memo.control_certs else None)
    memo.policies = PolicyRegistry()
    memo.admission = admission_policies.WebhookAdmissionPolicies()
    memo.http = aiohttp.ClientSession()  # rollout analysis: Prometheus and Alertmanager
    memo.rollout_metrics = metrics.RolloutMetrics()
    memo.metrics_runner = None
    if options.metrics_port:
        memo.metrics_runner = await metrics.serve(memo.rollout_metrics, options.metrics_host, options.metrics_port)


async def _control_certs(kube: Kube, options: OperatorOptions) -> control_certs.PolicyCerts | None:
    """The operator's CA (made once, kept in its Secret) and the issuer of policies'
    control certificates; None when the sidecars are told to serve plain HTTP."""
    if not options.sidecar_tls:
        log.warning("SIDECAR CONTROL API WITHOUT TLS (sidecar_tls off): sidecars serve plain HTTP and the "
                    "operator sends them no token")
        return None
    if not options.operator_namespace:
        raise kopf.PermanentError("sidecar TLS needs the operator's namespace (KVTIER_OPERATOR_OPERATOR_NAMESPACE): "
                                  "its CA Secret lives there")
    try:
        ca = await control_certs.ensure_ca(kube, options.operator_namespace, options.control_ca_secret)
    except control_certs.ControlCaError as exc:
        raise kopf.PermanentError(str(exc)) from None
    await control_certs.publish_ca(kube, options.operator_namespace, options.control_ca_secret, ca)
    return control_certs.PolicyCerts(ca)


async def _native_sidecars(kube: Kube) -> bool:
    """Whether injected sidecars are native ones (Kubernetes >= 1.29); an API server
    whose version cannot be read gets the plain container every version runs."""
    try:
        major, minor = await kube.server_version()
    except Exception as exc:  # noqa: BLE001 - any failure means: the portable form
        log.warning("API server version unreadable (%s): injecting the sidecar as a plain container", exc)
        return False
    native = injection.supports_native_sidecars(major, minor)
    log.info("API server %s.%s: injecting the sidecar as a %s", major, minor,
             "native sidecar (init container, restartPolicy Always)" if native else "plain container")
    return native


def _pod_tokens(kube: Kube, service_account: str) -> PodTokens | None:
    """Per-sidecar tokens minted for this operator's ServiceAccount ("namespace/name")."""
    if not service_account:
        return None
    namespace, _, name = service_account.partition("/")
    return PodTokens(lambda audience, ttl_s: kube.request_token(namespace, name, audience, ttl_s))


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """The pod's ServiceAccount in a cluster, else $KUBECONFIG as it is now."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    await rollout_warmup_io.stop_all(memo)
    await memo.sidecars.close()
    await memo.http.close()
    if memo.metrics_runner is not None:
        await memo.metrics_runner.cleanup()
    memo.kube.close()


@kopf.index(*POLICY)
def policies_by_namespace(namespace: str, name: str, spec: kopf.Spec, meta: kopf.Meta,
                          **_: Any) -> dict[str, tuple[str, dict, str]]:
    return {namespace: admission_policies.entry(name, spec, meta)}


def _policy_refs(entries: Any) -> list[conflicts.PolicyRef]:
    """The namespace's valid policies from the index (an invalid one selects nothing)."""
    refs = []
    for name, raw, created in entries:
        try:
            refs.append(conflicts.PolicyRef(name, created, policy.LabelSelector.model_validate(raw.get("selector") or {})))
        except ValueError:
            continue
    return refs


@kopf.index("", "v1", "pods")
def pods_by_namespace(namespace: str, body: kopf.Body, **_: Any) -> dict[str, PodView]:
    return {namespace: pod_view(body)}


def _poster(body: dict[str, Any]):
    def post(type_: str, reason: str, message: str) -> None:
        kopf.event(body, type=type_, reason=reason, message=message)
    return post


@kopf.on.resume(*POLICY)
@kopf.on.create(*POLICY)
@kopf.on.update(*POLICY, field="spec")
async def spec_changed(name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    memo.admission.mark_loaded()  # kopf calls no such handler before its indexes are loaded
    key = PolicyKey(namespace, name)
    registry: PolicyRegistry = memo.policies
    async with registry.lock(key):
        body = await memo.kube.read_policy(namespace, name)
        if body is None:
            return
        if memo.control_certs is not None:  # before the sidecar config: pods mount both
            await memo.control_certs.ensure(memo.kube, body)
        fields = await reconcile.reconcile_spec(memo.kube, body, _poster(body), memo.options.sidecar_access())
        await memo.kube.patch_status(namespace, name, fields)
    # Every policy of the namespace: a changed selector may start or end an overlap.
    registry.wake_namespace(namespace)


@kopf.daemon(*POLICY, cancellation_timeout=5.0)
async def membership_loop(
    name: str, namespace: str, body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped,
    pods_by_namespace: kopf.Index, policies_by_namespace: kopf.Index, **_: Any,
) -> None:
    key = PolicyKey(namespace, name)
    registry: PolicyRegistry = memo.policies
    trigger = registry.open_trigger(key)
    options: OperatorOptions = memo.options
    try:
        while not stopped:
            trigger.clear()
            views = list(pods_by_namespace.get(namespace, []))
            refs = _policy_refs(policies_by_namespace.get(namespace, []))
            try:
                async with registry.lock(key):
                    await reconcile.reconcile_membership(
                        memo.kube, memo.sidecars, namespace, name, views, registry.entry(key).state,
                        lambda t, r, m: kopf.event(body, type=t, reason=r, message=m), refs,
                    )
            except Exception as exc:  # keep the loop alive: the next trigger or resync retries
                if isinstance(exc, ApiException) and exc.status == 404:
                    # The policy was deleted between the read and the write: its daemon stops next.
                    log.info("membership reconcile of %s/%s: the policy is gone", namespace, name)
                else:
                    log.exception("membership reconcile of %s/%s failed; retrying", namespace, name)
                    await asyncio.sleep(1.0)
            try:
                behind = registry.entry(key).state.redis_behind
                await asyncio.wait_for(trigger.wait(),
                                       timeout=REDIS_RETRY_S if behind else options.resync_interval_s)
            except asyncio.TimeoutError:
                pass
            await asyncio.sleep(options.debounce_s)  # let a burst of pod events settle
    finally:
        registry.close_trigger(key)


@kopf.timer(*POLICY, id="hit-rate", interval=hit_rate.HIT_RATE_REFRESH_S)
async def hit_rate_tick(name: str, namespace: str, memo: kopf.Memo, pods_by_namespace: kopf.Index,
                        **_: Any) -> None:
    """kopf runs a timer's passes one after another (never two at once per policy)."""
    views = list(pods_by_namespace.get(namespace, []))
    await hit_rate.refresh(memo.kube, memo.sidecars, namespace, name, views,
                           memo.policies.entry(PolicyKey(namespace, name)))


@kopf.timer(*POLICY, id="control-cert", interval=control_certs.RENEW_CHECK_INTERVAL_S)
async def control_cert_tick(name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    """Renew the policy's control certificate when it is due (`control_ca.needs_renewal`)."""
    if memo.control_certs is None:
        return
    async with memo.policies.lock(PolicyKey(namespace, name)):
        body = await memo.kube.read_policy(namespace, name)
        if body is not None:
            await memo.control_certs.ensure(memo.kube, body)


@kopf.on.event(*POLICY)
def policy_gone(type: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    """A policy that has left the namespace's index (deleted, finalizers done) changes
    the others' view: the pods it injected are foreign to them now, its overlaps end."""
    if type == "DELETED":
        memo.policies.wake_namespace(namespace)


@kopf.on.event("", "v1", "pods")
def pod_changed(namespace: str, memo: kopf.Memo, **_: Any) -> None:
    memo.admission.mark_loaded()  # kopf calls no such handler before its indexes are loaded
    memo.policies.wake_namespace(namespace)


@kopf.on.mutate("", "v1", "pods", operations=["CREATE"], id="inject-sidecar", ignore_failures=True)
async def inject_sidecar(
    body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, policies_by_namespace: kopf.Index, **_: Any
) -> None:
    namespace = body.metadata.namespace
    entries = await memo.admission.entries(memo.kube, namespace, policies_by_namespace.get(namespace, []))
    refs = _policy_refs(entries)
    chosen = injection.selecting_policy(dict(body), refs)
    if chosen is None:
        if (unforged := injection.unforged(dict(body))) is not None:
            patch["metadata"] = unforged
        return
    spec = next((raw for name, raw, _created in entries if name == chosen), None)
    options: OperatorOptions = memo.options
    try:
        chosen_spec = sidecar_render.carried_out(spec)
        result = injection.inject(dict(body), chosen, chosen_spec, injection.SidecarImage(
            options, native=memo.get("native_sidecars", False)))
    except sidecar_render.BrokenPolicy as exc:
        # The owner's mistake is never the pod's: admit it without the sidecar, say why on
        # the pod, and let the policy's status name it (membership's SidecarsInjected).
        log.warning("pod %s/%s admitted without the sidecar: policy %s: %s", namespace,
                    body.metadata.name or body.metadata.get("generateName", ""), chosen, exc)
        patch["metadata"] = {"annotations": {names.INJECTION_SKIPPED_ANNOTATION: injection.skipped_note(chosen, exc)},
                             **(injection.unforged(dict(body)) or {})}
        return
    if result is not None:
        patch["metadata"] = result["metadata"]
        patch["spec"] = result["spec"]


@kopf.on.delete(*POLICY)
async def policy_deleted(name: str, namespace: str, spec: kopf.Spec, body: kopf.Body, memo: kopf.Memo,
                         **_: Any) -> None:
    # No pod may wait on a warm-up gate nobody will release (and the workload below
    # waits for ready pods): every gate of the policy's pods first, on every retry.
    await rollout_warmup_io.release_all(memo, namespace, name)
    # First the workload: a rollout in flight goes back to the stable version once this
    # operator's webhook serves (retried by kopf until the pods converge), then the
    # policy's own objects.
    await rollout_teardown.settle_workload(memo.kube, dict(body), _poster(dict(body)),
                                           lambda: webhook_gate.serving(memo))
    await rollout_warmup_io.release_all(memo, namespace, name)  # and the pods the rollback recreated
    redis_spec = spec.get("redis") or {}
    try:
        parsed = policy.KVCachePolicySpec.model_validate(dict(spec)) if redis_spec else None
    except ValueError:  # a spec no longer valid still goes: only its Redis key stays behind
        parsed = None
    url = await reconcile.redis_url(memo.kube, namespace, parsed) if parsed else None
    if url:
        await publish.delete_redis(url, namespace, name, bool(redis_spec.get("cluster")))
    for cm in (names.sidecar_config_map(name), names.affinity_config_map(name)):
        await memo.kube.delete_config_map(namespace, cm)
    memo.policies.forget(PolicyKey(namespace, name))
    memo.rollout_metrics.forget(namespace, name)  # no stale rollout series (and no stalled alert)


# The rollout's timer lives in its own module; importing it registers it with kopf.
from kvtier_operator import rollout_handlers  # noqa: E402,F401
