"""API keys: loading them, and checking a request's ``Authorization`` header in constant time.

Contract: ``load_api_keys(config)`` returns the configured keys: ``api_key`` plus every line of ``api_keys_file``
that is neither blank nor a ``#`` comment (surrounding whitespace stripped); an unreadable file, or one without a
key, is a ``ConfigError``. ``KeyChecker(keys)`` keeps only the keys' SHA-256 digests; ``check(header)`` returns
when the header is ``Bearer <one of the keys>`` and raises ``AuthenticationError`` otherwise. It compares the
digest of the presented token with every key's digest through ``hmac.compare_digest``, all of them every time,
so the time taken tells neither which key matched, nor how much of a key was right, nor a key's length. No key
and no presented token is ever logged or put into an error message.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from pathlib import Path

from server.config import ConfigError, ServerConfig
from server.errors import AuthenticationError

MISSING = "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
INCORRECT = "Incorrect API key provided."


def read_keys_file(path: str) -> list[str]:
    """The keys in ``path``: one per line, blank lines and ``#`` comments skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the API keys file {path}: {exc.__class__.__name__}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise ConfigError(f"the API keys file {path} holds no key")
    return keys


def load_api_keys(config: ServerConfig) -> tuple[str, ...]:
    """Every configured key (``api_key`` first), without duplicates; empty when auth is off."""
    keys = [config.api_key] if config.api_key else []
    if config.api_keys_file:
        keys.extend(read_keys_file(config.api_keys_file))
    return tuple(dict.fromkeys(keys))


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


class KeyChecker:
    """The server's keys as digests; ``check`` is the one place a request's key is judged."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = tuple(digest(key) for key in keys)

    @property
    def enabled(self) -> bool:
        """True when any key is configured (otherwise every request is let through)."""
        return bool(self._digests)

    def matches(self, token: str) -> bool:
        """Constant-time membership: every key is compared, whatever matched first."""
        presented = digest(token)
        found = False
        for expected in self._digests:
            found |= hmac.compare_digest(presented, expected)
        return found

    def check(self, authorization: str | None) -> None:
        """Return if auth is off or ``authorization`` is ``Bearer <a configured key>``; else 401."""
        if not self.enabled:
            return
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise AuthenticationError(MISSING)
        if not self.matches(token):
            raise AuthenticationError(INCORRECT)
