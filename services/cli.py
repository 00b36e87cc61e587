"""``prfaas``: one console command with a subcommand per service (pyproject ``[project.scripts]``).

``prfaas <service> [flags]`` runs that service exactly as ``python -m services.<module>`` does;
``prfaas <service> --help`` lists its flags with their defaults. Before the flags are parsed,
``prfaas`` reads ``./.env`` (or the file ``PRFAAS_ENV_FILE`` names) the way honcho does, without
overriding variables already set, so a service or ``prfaas status`` started by hand sees the same
addresses as under ``honcho start``.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

# subcommand -> (module with make_parser() and main(), one line for the command list)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "gateway": ("services.gateway.app", "OpenAI-compatible HTTP gateway"),
    "router": ("services.router.server", "router: places each request on a prefill and a decode worker"),
    "planner": ("services.planner.server", "planner: worker registry, load view and the scheduling loops"),
    "prefill": ("services.prefill.__main__", "prefill worker (--cluster prfaas: the PrfaaS cluster; pd: PD-P)"),
    "decode": ("services.decode.__main__", "decode worker (PD-D)"),
    "pd": ("services.pd.__main__", "switchable PD worker (PD-P or PD-D, moved by the planner)"),
    "status": ("services.planner.status", "print the planner's status, or move a PD worker (--move NAME=ROLE)"),
}


def load_env_file(path: Path, environ: dict[str, str] | None = None) -> list[str]:
    """Set the variables of the ``.env``-format file ``path`` (honcho's parser) that ``environ``
    (default ``os.environ``) does not have yet; returns their names. A missing file sets nothing."""
    from honcho.environ import parse

    env = os.environ if environ is None else environ
    if not path.is_file():
        return []
    added = []
    for key, value in parse(path.read_text()).items():
        if key not in env:
            env[key] = value
            added.append(key)
    return added


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in SUBCOMMANDS.items()]
    return ("usage: prfaas <command> [flags]   (prfaas <command> --help: its flags and defaults)\n\n"
            "PrfaaS, prefill-as-a-service LLM serving. Commands:\n" + "\n".join(lines) +
            "\n\nVariables from ./.env (or $PRFAAS_ENV_FILE) are read first; the environment wins.")


def entry(command: str) -> Callable[[], None]:
    """The ``main`` of ``command``. Raises ``KeyError`` for an unknown one."""
    return importlib.import_module(SUBCOMMANDS[command][0]).main


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        raise SystemExit(0 if args else 2)
    command = args[0]
    if command not in SUBCOMMANDS:
        print(f"prfaas: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        raise SystemExit(2)
    load_env_file(Path(os.environ.get("PRFAAS_ENV_FILE") or ".env"))
    sys.argv = [f"prfaas {command}", *args[1:]]
    entry(command)()


if __name__ == "__main__":
    main()
