"""What a tenant name may be: one rule, for every place a tenant crosses a process
boundary (the engine socket's key roots, the peer protocol, the control API's warm-ups
and stats) and is then used as a metric label, a key-root field or a log field.

    segments of letters, digits and _ : @ + = ~ - .   joined by "/"
    no segment starts with "."                        ("..", "./x" and "a/../b" are refused)
    1 to MAX_TENANT_CHARS characters                  (no NUL, no whitespace, no control bytes)

Routers name tenants by ids, e-mail-like handles or base64url salts; all of those fit.
"""
from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field

# Longest tenant name: a name, not a payload.
MAX_TENANT_CHARS = 256
_SEGMENT = r"[A-Za-z0-9_:@+=~-][A-Za-z0-9_.:@+=~-]*"
TENANT_PATTERN = rf"^{_SEGMENT}(/{_SEGMENT})*$"
_TENANT_RE = re.compile(TENANT_PATTERN)

TENANT_RULE = (f"1-{MAX_TENANT_CHARS} characters: letters, digits and _ : @ + = ~ - . in segments joined "
               "by '/', no segment starting with '.'")

# A tenant field of a request or wire model.
TenantName = Annotated[str, Field(min_length=1, max_length=MAX_TENANT_CHARS, pattern=TENANT_PATTERN)]


def is_tenant(name: str) -> bool:
    return 0 < len(name) <= MAX_TENANT_CHARS and _TENANT_RE.fullmatch(name) is not None


def check_tenant(name: str) -> str:
    """`name` when it is a tenant name; ValueError saying the rule otherwise."""
    if not is_tenant(name):
        raise ValueError(f"tenant {name[:64]!r} is not a tenant name ({TENANT_RULE})")
    return name
