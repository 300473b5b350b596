"""Which policies the injection webhook decides a pod from.

The webhook normally reads the operator's policy index (a kopf index over a watch),
but kopf serves admission requests as soon as its webhook server is up, which can be
before that index has loaded the policies that already exist. A pod admitted from an
index that is still empty starts without its sidecar for the rest of its life. So,
like a controller that reads from its informer cache only once the cache has synced,
the webhook answers from a direct apiserver LIST of the pod's namespace until the
index is known to be loaded, and from the index after that:

    loaded     kopf runs no regular handler (resume, create, event, daemon) before
               every index has finished its initial listing, so the first such
               handler call marks the index loaded (`mark_loaded`)
    fallback   a LIST that fails or times out falls back to the index (the best
               answer left; the pod is reported in status if that misses)

An index entry and a LIST item become the same `Entry`: (name, spec, creationTimestamp).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import urllib3
from kubernetes.client.rest import ApiException

log = logging.getLogger("kvtier.operator.admission")

Entry = tuple[str, dict, str]  # (policy name, spec, metadata.creationTimestamp)
# Under the webhook's 5 s timeoutSeconds with room for the patch: a slower LIST falls
# back to the index rather than letting the apiserver give up on the whole review.
LIST_TIMEOUT_S = 2.0


def entry(name: str, spec: Mapping[str, Any], meta: Mapping[str, Any]) -> Entry:
    """One policy as the webhook needs it (the index stores the same tuple). A policy
    being deleted gives its new pods no warm-before-ready gate: no rollout will warm
    them, and its finalizer's last gate release may already have run."""
    spec = dict(spec)
    if meta.get("deletionTimestamp") and isinstance(spec.get("rollout"), Mapping) and "warmup" in spec["rollout"]:
        spec["rollout"] = {k: v for k, v in spec["rollout"].items() if k != "warmup"}
    return name, spec, meta.get("creationTimestamp") or ""


def entries_of(items: Iterable[dict[str, Any]]) -> list[Entry]:
    """A LIST's items as entries."""
    return [entry(i["metadata"]["name"], i.get("spec") or {}, i["metadata"]) for i in items]


class WebhookAdmissionPolicies:
    """The webhook's view of a namespace's policies: the apiserver until the index is
    loaded, the index afterwards (kept in kopf's memo, one per operator run)."""

    def __init__(self) -> None:
        self.index_loaded = False

    def mark_loaded(self) -> None:
        if not self.index_loaded:
            log.info("policy index loaded: the injection webhook reads it from now on")
        self.index_loaded = True

    async def entries(self, kube, namespace: str, index_entries: Iterable[Entry]) -> list[Entry]:
        if self.index_loaded:
            return list(index_entries)
        try:
            return entries_of(await kube.list_policies(namespace, LIST_TIMEOUT_S))
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:  # refused, timed out, forbidden
            log.warning("listing policies in %s for admission failed (%s); answering from the index", namespace, exc)
            return list(index_entries)
