"""The `kvtier` command: one entry point, one module per subcommand.

Each subcommand lives in the module that owns its concern and exposes
`main(argv: list[str]) -> int`; this file only dispatches, importing lazily so
that `kvtier breakeven` does not pay for matplotlib or the Kubernetes client.
"""
from __future__ import annotations

import importlib
import os
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "breakeven": ("kvtier_app.breakeven_cli", "tier economics: break-even fetch bandwidth and per-medium verdicts"),
    "crd": ("kvtier_app.crd_cli", "generate the KVCachePolicy CustomResourceDefinition from the pydantic models"),
    "contract": ("kvtier_app.contract_cli", "write the affinity table's JSON Schema and shared pick vectors for router/"),
    "simulate": ("kvtier_app.simulate", "simulate a fleet: hit rate and prefill load per routing policy"),
    "demo": ("kvtier_app.demo", "the core end to end: a reference transformer served through LocalCache"),
}


def _usage() -> str:
    lines = ["usage: kvtier <command> [options]", "", "commands:"]
    width = max(len(name) for name in SUBCOMMANDS)
    for name, (_, summary) in SUBCOMMANDS.items():
        lines.append(f"  {name:<{width}}  {summary}")
    lines.append("")
    lines.append("Run `kvtier <command> --help` for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"kvtier: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    try:
        return int(module.main(rest) or 0)
    except BrokenPipeError:
        # `kvtier breakeven | head`: the reader left; that is not an error of ours.
        # Point stdout at devnull so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
