"""Does this operator's own injection webhook serve yet? Asked before any write that
makes the workload controller recreate pods (a rollout step, the rollback when a
policy is deleted mid-rollout): a pod created before the webhook serves starts
without its sidecar, because the webhook fails open (failurePolicy Ignore).

Probed with a TCP connect to the webhook's address; once seen serving it is
remembered for the rest of the operator's run (the memo), and an operator with no
webhook never waits. Once it serves it also answers correctly: until the policy index
is loaded it decides from the apiserver (`admission_policies`).
"""
from __future__ import annotations

import asyncio

import kopf

from kvtier_operator.options import OperatorOptions

# A local TCP connect: anything slower means the webhook is not serving yet.
PROBE_TIMEOUT_S = 1.0
# Between a refused probe and the next try of a handler that kopf retries (the
# delete handler's rollback): the webhook server starts within seconds of the operator.
RETRY_DELAY_S = 1.0


async def serving(memo: kopf.Memo) -> bool:
    """True once this operator's injection webhook accepts connections (or it has none)."""
    options: OperatorOptions = memo.options
    if not options.webhook_host or memo.get("webhook_serving"):
        return True
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(options.webhook_host, options.webhook_port),
                                           PROBE_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    await writer.wait_closed()
    memo.webhook_serving = True
    return True
