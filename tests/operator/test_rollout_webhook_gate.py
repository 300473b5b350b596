"""A rollout step recreates pods, so the operator takes none until its own injection
webhook accepts connections: a pod created before that (a restart's first seconds)
would start without the sidecar. Probed with real sockets on loopback."""
from __future__ import annotations

import asyncio
import socket

import kopf

from kvtier_operator.options import OperatorOptions
from kvtier_operator.webhook_gate import serving as _webhook_serving


def memo_for(port: int | None) -> kopf.Memo:
    memo = kopf.Memo()
    memo.options = OperatorOptions(webhook_host="127.0.0.1" if port else None, webhook_port=port or 0)
    return memo


def test_no_rollout_step_while_the_webhook_port_refuses_connections():
    unused = socket.socket()
    unused.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    try:
        assert asyncio.run(_webhook_serving(memo_for(unused.getsockname()[1]))) is False
    finally:
        unused.close()


def test_rollout_steps_once_the_webhook_listens_and_it_is_not_probed_again():
    server = socket.create_server(("127.0.0.1", 0))
    memo = memo_for(server.getsockname()[1])
    try:
        assert asyncio.run(_webhook_serving(memo)) is True
    finally:
        server.close()
    assert asyncio.run(_webhook_serving(memo)) is True  # remembered: the port is closed now


def test_an_operator_without_a_webhook_never_waits_for_one():
    assert asyncio.run(_webhook_serving(memo_for(None))) is True
