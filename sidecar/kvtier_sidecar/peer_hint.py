"""A lookup's peer-pull hint, mapped to a peer this sidecar already trusts.

A router that knows which pod holds a request's prefix (llm-d's sets
`x-kv-cache-source-host-port`) names it; the hint reaches the sidecar with the engine's
LOOKUP (`engine_proto.SOURCE_PEER_FIELD`). It comes from a request, so it is a
preference, never an address to dial: the sidecar asks only a member of its own fleet,

  - a peer listed in `warm_peers` (the operator's word), or
  - a live member of the global index (a heartbeat written by a sidecar holding the
    Redis credentials; this sidecar's member list as of its last heartbeat, so no round
    trip on the request path),

and only over the authenticated peer transport, as it asks any peer. The router names
a pod by its engine's address (pod IP and the engine's port) while a sidecar advertises
its peer port, so a hint matches a member by its exact address, else by its host alone
when exactly one member has that host. A hint naming this sidecar itself, or nothing
that matches, is no hint (`unknown`). What the peer then sends is verified block by
block like any peer's (`peer_fetch`): the hint only decides who is asked first.
"""
from __future__ import annotations

from collections.abc import Callable, Collection

from kvtier.peer_address import PeerAddress, parse_peer


class _Members:
    """One member list, indexed by canonical address and by host."""

    __slots__ = ("by_address", "by_host")

    def __init__(self, members: list[str]) -> None:
        self.by_address: dict[str, str] = {}
        self.by_host: dict[str, list[str]] = {}
        for member in dict.fromkeys(members):  # one member listed twice is still one
            try:
                address = parse_peer(member)
            except ValueError:
                continue  # an advertised address peers could not dial either
            self.by_address[str(address)] = member
            self.by_host.setdefault(address.host, []).append(member)


class HintedPeers:
    """`resolve(hint)`: the member to ask first, or None. `index_members()` is the global
    index's live member set (None without an index), `warm_peers()` the config's list,
    `me` this sidecar's advertised address (a hint naming it is no peer)."""

    def __init__(self, index_members: Callable[[], Collection[str] | None],
                 warm_peers: Callable[[], list[str]], me: Callable[[], str | None]) -> None:
        self._index_members = index_members
        self._warm_peers = warm_peers
        self._me = me
        # The member list indexed once per heartbeat (the index replaces its set) and
        # per config, not per hinted lookup.
        self._key: tuple[int, int] | None = None
        self._sources: tuple[object, object] | None = None  # kept alive: ids stay theirs
        self._members = _Members([])

    def resolve(self, hint: str) -> str | None:
        try:
            address = parse_peer(hint)
        except ValueError:
            return None
        members = self._current()
        me = self._me()
        mine = _parsed(me) if me else None
        if mine is not None and (address == mine or address.host == mine.host):
            return None  # this pod itself: its own tiers already answered
        found = members.by_address.get(str(address))
        if found is None:
            same_host = members.by_host.get(address.host, ())
            found = same_host[0] if len(same_host) == 1 else None
        return found if found is not None and self._still_member(found) else None

    def _still_member(self, member: str) -> bool:
        """The index forgets a member that failed a fetch in place (until its next
        heartbeat), which the indexed copy does not see."""
        index = self._index_members()
        return (index is not None and member in index) or member in self._warm_peers()

    def _current(self) -> _Members:
        index, warm = self._index_members(), self._warm_peers()
        key = (id(index), id(warm))
        if key != self._key:
            self._members = _Members([*(index or ()), *warm])
            self._key, self._sources = key, (index, warm)
        return self._members


def _parsed(address: str) -> PeerAddress | None:
    try:
        return parse_peer(address)
    except ValueError:
        return None
