"""Events posted exactly once: named by what happened, so a crash after the create and
the retried pass that re-posts it finds it there (409) instead of repeating it."""
from __future__ import annotations

import hashlib
from datetime import datetime, timezone
from typing import Any

from kvtier import policy

# The API server's limit on an Event message is larger; this keeps `kubectl describe` readable.
MAX_MESSAGE = 1024


def once(body: dict[str, Any], happening: str, type_: str, reason: str, message: str) -> dict[str, Any]:
    """A core/v1 Event about the policy `body`, named by (policy uid, `happening`, reason)."""
    meta = body["metadata"]
    key = hashlib.sha256(f"{meta.get('uid')}/{happening}/{reason}".encode()).hexdigest()[:16]
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{key}", "namespace": meta["namespace"]},
        "involvedObject": {"apiVersion": f"{policy.GROUP}/{policy.VERSION}", "kind": policy.KIND,
                           "name": meta["name"], "namespace": meta["namespace"], "uid": meta.get("uid")},
        "type": type_, "reason": reason, "message": message[:MAX_MESSAGE], "count": 1,
        "firstTimestamp": now, "lastTimestamp": now, "source": {"component": "kvtier-operator"},
    }
