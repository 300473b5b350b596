"""The connector's side of the peer-pull hint: a request's kv_transfer_params
{"kvtier": {"sourcePeer": "host:port"}} (what kvtier's Endpoint Picker plugin writes
from llm-d's `x-kv-cache-source-host-port`) is read strictly, sent with the request's
one lookup, and counted; a malformed one is ignored (the lookup goes out without it),
counted, and never an error for the request."""
from __future__ import annotations

import pytest

from kvtier.keys import KeyRoot
from kvtier_vllm.lookups import AsyncLookups, Breaker
from kvtier_vllm.plan import Hint, SchedulerBook, read_hint

BLOCK = 16
ROOT = KeyRoot("t", "reference-tiny", "dev", "float32", "rope-default", "sdpa")


def params(value) -> dict:
    return {"kvtier": {"sourcePeer": value}}


@pytest.mark.parametrize("value, peer", [
    ("10.0.0.7:8200", "10.0.0.7:8200"),
    ("10.0.0.7:1", "10.0.0.7:1"),
    ("10.0.0.7:65535", "10.0.0.7:65535"),
    ("[FD00::7]:7400", "[fd00::7]:7400"),
    ("Pod-0.Serving.NS.svc:7400", "pod-0.serving.ns.svc:7400"),
])
def test_a_host_port_is_the_hint_in_its_canonical_form(value, peer):
    assert read_hint(params(value)) == Hint(peer)
    # beside other connectors' entries and kvtier's own other fields
    assert read_hint({"nixl": {"x": 1}, "kvtier": {"purpose": "warmup", "sourcePeer": value}}) == Hint(peer)


@pytest.mark.parametrize("kv_transfer_params", [
    None, {}, [], "text", 7, {"nixl": {"sourcePeer": "10.0.0.7:80"}}, {"kvtier": None}, {"kvtier": "x"},
    {"kvtier": ["sourcePeer"]}, {"kvtier": {}}, {"kvtier": {"purpose": "warmup"}},
    {"sourcePeer": "10.0.0.7:80"},
])
def test_no_hint_where_kv_transfer_params_names_none(kv_transfer_params):
    assert read_hint(kv_transfer_params) is None


@pytest.mark.parametrize("value", [
    None, 7, 7.5, True, [], {}, ["10.0.0.7:80"], {"host": "10.0.0.7", "port": 80},
    "", " ", "10.0.0.7", "10.0.0.7:", ":8200", "10.0.0.7:0", "10.0.0.7:65536", "10.0.0.7:-1", "10.0.0.7:+80",
    "10.0.0.7:000080", "10.0.0.7:80x", " 10.0.0.7:80", "10.0.0.7:80 ", "10.0.0.7:8200:1", "fd00::7:80",
    "[fd00::7%eth0]:80", "999.0.0.1:80", "1.2.3:80", "localhost:80", "pod_1.ns:80", "-pod.ns:80", "a b.ns:80",
    "http://10.0.0.7:80", "10.0.0.7:80/x", "10.0.0.7:\u0668\u0660", "p\u00f6d.ns:80", "a." * 127 + "ab:80",
    "x" * 300 + ".ns:80",
])
def test_a_malformed_hint_is_ignored_and_marked_for_counting(value):
    assert read_hint(params(value)) == Hint(None, invalid=True)


class RecordingClient:
    """The engine client's lookup as AsyncLookups calls it: records what it was asked."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def lookup(self, root, token_ids, digests=False, local_tokens=0, purpose=None, **hint):
        self.calls.append(hint)
        return None  # a miss

    def release(self, hit) -> None:
        pass


def test_the_hint_goes_out_with_the_requests_one_lookup_and_is_counted_once():
    client = RecordingClient()
    book = SchedulerBook(AsyncLookups(client, 30.0, Breaker(30.0)), BLOCK, BLOCK, verify_checksums=False)
    prompt = list(range(1, 4 * BLOCK))
    for req_id, hint in (("plain", None), ("hinted", read_hint(params("10.0.0.7:8200"))),
                         ("bad", read_hint(params("10.0.0.7")))):
        assert book.matched(req_id, ROOT, prompt, 0, 30.0, hint=hint) == 0
        assert book.matched(req_id, ROOT, prompt, 0, 30.0, hint=hint) == 0  # asked again: no second lookup
    # A lookup without a (valid) hint is the very call it always was: no source_peer at all.
    assert client.calls == [{}, {"source_peer": "10.0.0.7:8200"}, {}]
    counts = book.take_counts()
    assert (counts["lookups"], counts["peer_hints"], counts["peer_hints_invalid"]) == (3, 1, 1)
