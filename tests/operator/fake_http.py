"""The engine's answer to a warm-up prompt, as the operator's aiohttp session sees it:
a 200 with an empty JSON body, usable as `async with session.post(...) as resp`."""
from __future__ import annotations


class OkResponse:
    status = 200

    async def read(self) -> bytes:
        return b"{}"

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        return None
