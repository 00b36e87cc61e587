"""Role-separated credentials for the handshake MAC: who a process is, and which keys it holds.

Every process speaks as one *role*: ``gateway``, ``router``, ``planner``, ``worker`` (prefill, decode
and PD workers, KV senders and receivers) or ``operator`` (the status CLI, tests, benchmarks). A
connection from a dialler of role ``R`` to a listener of role ``Q`` is authenticated with the pair
key ``K(R>Q) = HMAC-SHA256(master, "prfaas-pair-key|R>Q")``. A process therefore holds:

- the *master* secret (``PRFAAS_SHARED_SECRET`` / ``PRFAAS_SHARED_SECRET_FILE``): it can derive
  every pair key, so it may speak as any role. This is the simple set-up, and what a single
  trusted host runs;
- or a *credentials file* (``PRFAAS_CREDENTIALS_FILE``, written by ``python -m common.rpc.credentials
  issue``): its role and only the pair keys that role needs: ``R>Q`` for each listener role ``Q`` it
  dials (:data:`DIALS`) and ``R'>R`` for each role ``R'`` that dials it. The gateway's file holds no
  key that listeners of the planner or of workers accept from a worker or the planner, so the
  gateway cannot register or move workers; no worker's file holds ``operator>planner``, so no
  worker can call ``move_worker``.

Limit of symmetric keys: a listener that accepts role ``R'`` holds ``K(R'>R)`` and could speak as
``R'`` *to listeners of its own role* (a worker holding ``planner>worker`` could call another
worker's ``switch_role``). Method permissions are enforced by the listener
(:class:`common.rpc.server.RpcServer` ``allow``).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import sys
from pathlib import Path

ROLES = ("gateway", "router", "planner", "worker", "operator")
# Which listener roles each role dials (what its credentials file holds keys for).
DIALS: dict[str, tuple[str, ...]] = {
    "gateway": ("router", "planner", "worker"),
    "router": ("planner",),
    "planner": ("router", "worker"),
    "worker": ("planner", "router", "worker"),
    "operator": ROLES,
}
_SERVICE_ROLES = {"gateway": "gateway", "router": "router", "planner": "planner"}
_WORKER_SERVICES = frozenset({"prefill", "decode", "pd", "kv-sender", "kv-receiver"})


def role_of_service(service: str) -> str:
    """The role a process or listener of ``service`` speaks as: the gateway, router and planner are
    their own; prefill, decode, PD workers and KV endpoints are ``worker``; anything else (the
    status CLI, tests, benchmarks) is ``operator``."""
    if service in _SERVICE_ROLES:
        return _SERVICE_ROLES[service]
    return "worker" if service in _WORKER_SERVICES else "operator"


def pair_key(master: bytes, dialler: str, listener: str) -> bytes:
    """``K(dialler>listener)`` derived from the master secret (32 bytes)."""
    return hmac.new(master, f"prfaas-pair-key|{dialler}>{listener}".encode(), hashlib.sha256).digest()


class Credentials:
    """What one process proves itself with: its ``role`` and either the ``master`` secret (every
    pair key) or the pair keys in ``keys`` (``{"R>Q": key bytes}``)."""

    def __init__(self, role: str, *, master: bytes | None = None, keys: dict[str, bytes] | None = None):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if (master is None) == (keys is None):
            raise ValueError("give either the master secret or the pair keys")
        self.role = role
        self.master = master
        self.keys = dict(keys or {})

    def key(self, dialler: str, listener: str) -> bytes | None:
        """``K(dialler>listener)`` if this process holds it, else None."""
        if self.master is not None:
            return pair_key(self.master, dialler, listener)
        return self.keys.get(f"{dialler}>{listener}")

    def as_role(self, role: str) -> Credentials:
        """The same keys speaking as ``role`` (only meaningful with the master secret; a file's role is fixed)."""
        return Credentials(role, master=self.master) if self.master is not None else self

    @classmethod
    def from_file(cls, path: str | Path) -> Credentials:
        """Load a file written by :func:`issue`. Raises ``ValueError`` for a malformed file, ``OSError``."""
        data = json.loads(Path(path).read_text())
        try:
            return cls(data["role"], keys={k: bytes.fromhex(v) for k, v in data["keys"].items()})
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: not a credentials file ({e})") from None


def keys_for(master: bytes, role: str) -> dict[str, bytes]:
    """The pair keys a process of ``role`` needs (see the module docstring)."""
    pairs = {(role, q) for q in DIALS[role]} | {(r, role) for r in ROLES if role in DIALS[r]}
    return {f"{r}>{q}": pair_key(master, r, q) for r, q in sorted(pairs)}


def issue(master: bytes, out: Path) -> list[Path]:
    """Write one credentials file per role into ``out`` (mode 0600); returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for role in ROLES:
        path = out / f"{role}.json"
        body = json.dumps({"role": role, "keys": {k: v.hex() for k, v in keys_for(master, role).items()}}, indent=1)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(body + "\n")
        paths.append(path)
    return paths


def main() -> None:
    """``python -m common.rpc.credentials issue --out DIR``: one credentials file per role from the
    master secret in ``PRFAAS_SHARED_SECRET`` / ``PRFAAS_SHARED_SECRET_FILE``."""
    from common.rpc.auth import load_secret

    p = argparse.ArgumentParser(description="issue role-separated PrfaaS credentials from the master secret")
    p.add_argument("command", choices=["issue"])
    p.add_argument("--out", required=True, type=Path, help="directory for <role>.json files")
    args = p.parse_args()
    master = load_secret()
    if master is None:
        sys.exit("error: set PRFAAS_SHARED_SECRET or PRFAAS_SHARED_SECRET_FILE to the master secret")
    for path in issue(master, args.out):
        print(path)


if __name__ == "__main__":
    main()
