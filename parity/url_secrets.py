"""Credentials inside URLs (a Redis URL's password, an OTLP endpoint's user and password).

A URL can carry a password two ways: in its user part (`redis://:PW@host`, `https://u:PW@host`) or
as a query parameter (`redis://host/0?password=PW`, which redis-py reads too). `url_password` finds
either; `redact_url` replaces both with *** for logs, records and written configs.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qs, urlsplit

_USER_PASSWORD = re.compile(r"(://[^:/@]*:)[^@/]+@")
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)


def url_password(url: str) -> str | None:
    """The password `url` carries, or None (also for a string that is not a URL)."""
    try:
        parts = urlsplit(url)
        if parts.password:
            return parts.password
    except ValueError:
        return None
    query = {k.lower(): v for k, v in parse_qs(parts.query).items()}
    return next((v for v in query.get("password", []) if v), None)


def redact_url(url: str) -> str:
    """`url` with any password replaced by ***."""
    return _QUERY_PASSWORD.sub(r"\1***", _USER_PASSWORD.sub(r"\1***@", url))
