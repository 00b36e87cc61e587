"""Temporary changes to this process's environment, undone exactly.

Labs set variables in ``os.environ`` (a shared secret, tighter limits) so that this process's own
clients and probes, and every process it starts, see them. A later test in the same process must not
inherit them, so each lab keeps an :class:`EnvOverlay` and restores it when it stops.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


class EnvOverlay:
    """Variables set in ``os.environ`` on top of what was there, and undone by :meth:`restore`.

    The first :meth:`set` of a name remembers its value before (or its absence); :meth:`restore`
    puts every remembered name back and forgets them, so it is idempotent. Not thread-safe (like
    ``os.environ`` itself)."""

    def __init__(self) -> None:
        self._before: dict[str, str | None] = {}

    def set(self, name: str, value: str) -> None:
        """``os.environ[name] = value``, remembering what ``name`` held before the first change."""
        self._before.setdefault(name, os.environ.get(name))
        os.environ[name] = value

    def update(self, values: Mapping[str, str]) -> None:
        """:meth:`set` for each item of ``values``."""
        for k, v in values.items():
            self.set(k, v)

    @property
    def changed(self) -> bool:
        """Whether anything is set that :meth:`restore` would undo."""
        return bool(self._before)

    def restore(self) -> None:
        """Put every changed name back as it was (absent names are removed again)."""
        for k, v in self._before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self._before.clear()


def has_secret(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``env`` (default ``os.environ``) names a shared secret or a credentials file, which
    services bound to a non-loopback address need."""
    e = os.environ if env is None else env
    return bool(e.get("PRFAAS_SHARED_SECRET") or e.get("PRFAAS_SHARED_SECRET_FILE") or e.get("PRFAAS_CREDENTIALS_FILE"))
