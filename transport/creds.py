"""A NATS credentials file and the URL or variable that names one: what a client logs in with.

The keys that sign these files, and the accounts behind them, are `transport.auth`'s; this module
only reads, writes and points at a ``.creds`` file, so the bus and the SDK can log in without
the operator's key store::

    who = Credentials.read(Path("acme.creds"))       # who.user, who.tenant, who.expired()
    url = who.url("nats://127.0.0.1:4222")           # nats://127.0.0.1:4222?creds=/abs/acme.creds
    assert url_creds(url) == who.path.resolve()
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

from transport import nats_jwt
from protocol.errors import InvalidField, NotFound

ENV_CREDS = "NEXUS_CREDS"


def creds_from_env() -> Path | None:
    """The credentials file named by ``NEXUS_CREDS`` (the one place that variable is read)."""
    from protocol.settings import AuthSettings

    return AuthSettings.from_env().creds


@dataclass(frozen=True)
class Credentials:
    """A NATS ``.creds`` file: the user's JWT (signed by its account) and its seed."""

    text: str
    path: Path | None = None

    @classmethod
    def read(cls, path: Path) -> Credentials:
        path = Path(path)
        try:
            text = path.read_text()
            nats_jwt.parse_creds(text)
        except FileNotFoundError:
            raise NotFound(f"credentials file {path} does not exist", details={"creds": str(path)}) from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidField("creds", f"{path} is not a NATS credentials file (from `nexus up` or "
                                        f"`nexus tenant create`): {exc}") from None
        return cls(text=text, path=path)

    @property
    def _claims(self) -> dict:
        return nats_jwt.decode_claims(nats_jwt.parse_creds(self.text)[0])

    @property
    def user(self) -> str:
        """The user's name (a tenant's user is named after it)."""
        return str(self._claims.get("name", ""))

    @property
    def account(self) -> str:
        """The public key of the account the user belongs to (its JWT's issuer)."""
        return str(self._claims.get("iss", ""))

    @property
    def user_key(self) -> str:
        return str(self._claims.get("sub", ""))

    @property
    def expires_at(self) -> int | None:
        """When the server stops accepting these credentials (unix seconds); None: never."""
        exp = self._claims.get("exp")
        return int(exp) if exp else None

    def expired(self) -> bool:
        return self.expires_at is not None and self.expires_at <= time.time()

    @property
    def tenant(self) -> str | None:
        """The tenant these credentials log in as; None for the platform's and the admin's."""
        return tenant_of_tags(self._claims.get("nats", {}).get("tags") or [])

    def write(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.text)
        tmp.replace(path)
        return path

    def connect_options(self) -> dict[str, Any]:
        """nats.connect keyword arguments for these credentials."""
        from nats.aio.client import RawCredentials

        return {"user_credentials": RawCredentials(self.text)}

    def url(self, url: str) -> str:
        """``url`` (comma-separated servers) naming this credentials file (``?creds=PATH`` on
        each server): `transport.bus.Bus.connect` logs in with it when given no other."""
        if self.path is None:
            raise InvalidField("creds", "these credentials have no file to name in a URL")
        query = urlencode({CREDS_PARAM: str(Path(self.path).resolve())}, safe="/")
        return ",".join(urlunsplit(urlsplit(strip_userinfo(u.strip()))._replace(query=query))
                        for u in url.split(",") if u.strip())


TENANT_TAG = "nexus-tenant:"  # a tenant user's JWT tag; the server asserts it with each request


def tenant_of_tags(tags: list) -> str | None:
    """The tenant a user JWT's tags name (``nexus-tenant:NAME``), or None."""
    for tag in tags:
        if isinstance(tag, str) and tag.startswith(TENANT_TAG):
            return tag[len(TENANT_TAG):] or None
    return None


# A URL may name the credentials file to log in with: nats://host:4222?creds=/path/x.creds.
CREDS_PARAM = "creds"


def url_creds(url: str) -> Path | None:
    """The credentials file a URL names (the first server's that does), or None."""
    for one in url.split(","):
        found = parse_qs(urlsplit(one.strip()).query).get(CREDS_PARAM)
        if found:
            return Path(found[0])
    return None


def strip_userinfo(url: str) -> str:
    """One server URL without ``user:password@`` or ``?creds=`` (the plain address)."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rsplit("@", 1)[-1], parts.path, "", parts.fragment))


def redact_url(url: str) -> str:
    """``url`` without passwords or credential paths (for logs and error messages)."""
    return ",".join(strip_userinfo(one.strip()) for one in url.split(",") if one.strip())


