"""NATS decentralized auth, the few pieces we sign: nkeys, JWT v2 claims, creds files.

nats-server in operator mode trusts one operator key; the operator signs account JWTs, an
account signs its users' JWTs. The claim layout is nats-io/jwt v2's (``nats.type`` operator /
account / user, ``version: 2``), signed ed25519 over ``header.payload`` with the ``nkeys``
package::

    op = new_key("operator")
    acct = new_key("account")
    account_jwt = encode(op, public(acct), "PLATFORM", {"type": "account", "version": 2, ...})
    text = creds_text(encode(acct, public(user), "alice", user_claims()), user)

Only the fields we use are written; the server fills in defaults for the rest.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import time
from typing import Any

import nkeys

_PREFIX = {"operator": nkeys.PREFIX_BYTE_OPERATOR, "account": nkeys.PREFIX_BYTE_ACCOUNT,
           "user": nkeys.PREFIX_BYTE_USER}
_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
# -1: no limit (nats-io/jwt's NoLimit). Core NATS limits of every account and user we sign.
NO_LIMIT = -1
CORE_LIMITS = {"subs": NO_LIMIT, "data": NO_LIMIT, "payload": NO_LIMIT, "imports": NO_LIMIT,
               "exports": NO_LIMIT, "wildcards": True, "conn": NO_LIMIT, "leaf": NO_LIMIT}


def new_key(kind: str) -> str:
    """A fresh seed (``S...``) of an operator, account or user key."""
    return nkeys.encode_seed(os.urandom(32), _PREFIX[kind]).decode()


def keypair(seed: str) -> nkeys.KeyPair:
    return nkeys.from_seed(seed.encode())


def public(seed: str) -> str:
    """The public key (``O...``, ``A...``, ``U...``) of a seed."""
    return keypair(seed).public_key.decode()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def encode(issuer_seed: str, subject: str, name: str, nats: dict[str, Any], *,
           expires_at: int | None = None) -> str:
    """A JWT of ``nats`` claims about ``subject``, signed by ``issuer_seed``; ``expires_at``
    (unix seconds) its ``exp``: the server refuses the JWT after it, and closes connections
    logged in with it then.

    ``jti`` is random: the server's full resolver keeps an update whose ``iat`` equals the
    stored one only when its id differs (two changes within one second must both land)."""
    kp = keypair(issuer_seed)
    claims = {"jti": base64.b32encode(secrets.token_bytes(32)).rstrip(b"=").decode(),
              "iat": int(time.time()), "iss": kp.public_key.decode(), "name": name, "sub": subject,
              "nats": nats}
    if expires_at is not None:
        claims["exp"] = int(expires_at)
    signing_input = f"{_b64(json.dumps(_HEADER).encode())}.{_b64(json.dumps(claims).encode())}"
    return f"{signing_input}.{_b64(kp.sign(signing_input.encode()))}"


def decode_claims(token: str) -> dict[str, Any]:
    """The claims of a JWT, unverified (the server verifies; we read our own files)."""
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


def operator_claims(system_account: str) -> dict[str, Any]:
    return {"type": "operator", "version": 2, "system_account": system_account}


def account_claims(*, jetstream: dict[str, int] | None = None, exports: list[dict] | None = None,
                   imports: list[dict] | None = None, revocations: dict[str, int] | None = None,
                   limits: dict[str, int] | None = None) -> dict[str, Any]:
    """An account: its limits (no JetStream unless ``jetstream`` gives its limits; ``limits``
    overrides `CORE_LIMITS` entries, e.g. ``conn``, ``subs``, ``payload``), the subjects it
    exports and imports, and the user keys it revoked (key -> unix time: every user JWT of
    that key issued at or before it is refused, and its connections closed)."""
    js = jetstream or {"mem_storage": 0, "disk_storage": 0, "streams": 0, "consumer": 0}
    unknown = set(limits or {}) - set(CORE_LIMITS)
    if unknown:
        raise ValueError(f"not core account limits: {sorted(unknown)} (known: {sorted(CORE_LIMITS)})")
    out: dict[str, Any] = {"type": "account", "version": 2, "limits": {**CORE_LIMITS, **(limits or {}), **js}}
    if exports:
        out["exports"] = exports
    if imports:
        out["imports"] = imports
    if revocations:
        out["revocations"] = revocations
    return out


def user_claims(tags: list[str] | None = None, permissions: dict[str, Any] | None = None) -> dict[str, Any]:
    """A user with every permission inside its account (the account is the boundary), or
    only ``permissions``: nats-io/jwt v2's ``pub`` / ``sub`` (``{"allow": [...], "deny":
    [...]}``) and ``resp`` (``{"max": N, "ttl": nanoseconds}``: it may answer a request it
    received, whatever ``pub`` says), as `transport.permissions` derives them for a role."""
    out: dict[str, Any] = {"type": "user", "version": 2, "pub": {}, "sub": {},
                           "subs": NO_LIMIT, "data": NO_LIMIT, "payload": NO_LIMIT}
    if permissions:
        out.update({k: permissions[k] for k in ("pub", "sub", "resp") if k in permissions})
    if tags:
        out["tags"] = tags
    return out


def creds_text(user_jwt: str, user_seed: str) -> str:
    """A ``.creds`` file as `nsc` writes it (nats.py's ``user_credentials`` reads it)."""
    return ("-----BEGIN NATS USER JWT-----\n"
            f"{user_jwt}\n"
            "------END NATS USER JWT------\n\n"
            "************************* IMPORTANT *************************\n"
            "NKEY Seed printed below can be used to sign and prove identity.\n"
            "NKEYs are sensitive and should be treated as secrets.\n\n"
            "-----BEGIN USER NKEY SEED-----\n"
            f"{user_seed}\n"
            "------END USER NKEY SEED------\n\n"
            "*************************************************************\n")


def parse_creds(text: str) -> tuple[str, str]:
    """(user JWT, user seed) of a ``.creds`` file; ValueError when it is not one."""
    blocks: list[str] = []
    lines = iter(text.splitlines())
    for line in lines:
        if line.startswith("-----BEGIN ") and line.rstrip().endswith("-----"):
            body = next(lines, "").strip()
            blocks.append(body)
    if len(blocks) < 2 or not blocks[0].startswith("ey") or not blocks[1].startswith("SU"):
        raise ValueError("not a NATS creds file (a user JWT block, then a user seed block)")
    return blocks[0], blocks[1]
