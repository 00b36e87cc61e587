"""API keys at the gateway (``--api-key``, ``PRFAAS_API_KEY``): which paths need one and whether a
request's ``Authorization: Bearer <key>`` holds one of them.

Every path needs a key when keys are configured, except the operational ones in :data:`OPEN_PATHS`
(``/health`` and ``/metrics`` stay open, as in vLLM). vLLM checks keys on ``/v1/*`` only; here
``/tokenize`` and ``/detokenize`` need one too, so nothing that runs the tokenizer is open. Keys are
compared in constant time. Pure: no aiohttp.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

OPEN_PATHS = frozenset({"/health", "/metrics"})


def parse_keys(flags: Iterable[str] | None, env: str | None) -> tuple[str, ...]:
    """The accepted keys: every ``--api-key`` value, else ``PRFAAS_API_KEY`` split on commas; blanks
    dropped. Empty: no key is required."""
    raw = list(flags or ()) or (env or "").split(",")
    return tuple(dict.fromkeys(k.strip() for k in raw if k.strip()))


class ApiKeys:
    """The configured keys (none: every request is let through)."""

    def __init__(self, keys: Iterable[str] = ()):
        self._keys = tuple(k.encode() for k in keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def needed(self, path: str) -> bool:
        """Whether a request to ``path`` must carry a key."""
        return self.enabled and path not in OPEN_PATHS

    def allows(self, authorization: str | None) -> bool:
        """Whether the ``Authorization`` header value holds ``Bearer <one of the keys>``."""
        if not authorization:
            return False
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = token.strip().encode()
        ok = False
        for k in self._keys:  # no early exit: the time does not tell which key matched
            ok |= hmac.compare_digest(given, k)
        return ok
