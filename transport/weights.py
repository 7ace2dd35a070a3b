"""Exported weights in the weights bucket: object names, reading, and the load-time check.

    name = weights_name("acme", 3)                 # 'acme/v00000003'
    payload = await get_object(store, name)
    manifest = await get_manifest(store, name)     # the JSON written next to it by an export
    check_manifest(manifest, name, base=..., key=slot.key, signature=cfg.signature)

An export is two objects: the payload (the head's params) and ``<name>.manifest.json``, which
says which base (``base``, ``base_key``, ``base_identity``) and which schema
(``schema_signature``) it was trained for. Whoever loads a payload into a slot (an inferencer
serving a version, a trainer's ``load_weights``) checks the manifest against its own base and
the tenant's schema first: a head trained on another base's features would run without an
error and serve garbage.

Shared by the trainer (actors/trainer/slots.py), the inferencer (actors/inferencer/serving.py), the master and the
SDK (which name and read exports too): on the transport floor, below all of them.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
from typing import Any

from nats.js.errors import ObjectNotFoundError

from protocol.errors import FailedPrecondition

MANIFEST_FORMAT = "vla-nexus/adapter-manifest/1"
MANIFEST_SUFFIX = ".manifest.json"


def weights_name(tenant: str, version: int) -> str:
    return f"{tenant}/v{version:08d}"


def manifest_name(object_name: str) -> str:
    return object_name + MANIFEST_SUFFIX


# Chunks fetched per pull request (128 KiB each by default: 8 MiB per round trip).
PULL_BATCH = 64
PULL_TIMEOUT_S = 10.0  # one batch of chunks at most this long (the whole get is js_retry's)


async def get_object(store: Any, name: str) -> bytes:
    from transport.bus import js_retry

    async def once() -> bytes:
        # writeinto avoids nats-py's quadratic bytes concatenation for large objects; a fresh
        # buffer per attempt, so a retry after a timeout never appends to half an object.
        buf = io.BytesIO()
        await store.get(name, writeinto=buf)
        return buf.getvalue()

    if getattr(store, "_js", None) is None or getattr(store, "_name", None) is None:
        return await js_retry(once)
    return await js_retry(lambda: _pull_get(store, name))


async def _pull_get(store: Any, name: str) -> bytes:
    """An object's chunks through an ephemeral pull consumer, digest checked as nats-py does.

    Why not `ObjectStore.get`: its ordered push consumer stalls on flow control past ~2 MiB
    (measured here: 8 MiB in 0.53 s, 16 MiB in 0.84 s; pulled: 0.04 s and 0.10 s), and a
    weights payload of a 4B base's head is several MiB: it was most of the weight sync
    (docs/benchmarks.md, issue 27 item 5). Links and empty objects take the library's path."""
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
    from nats.js.errors import DigestMismatchError
    from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_DIGEST_TYPE, OBJ_STREAM_TEMPLATE

    info = await store.get_info(name)
    if info.is_link() or not info.size or not info.nuid or not info.chunks:
        buf = io.BytesIO()
        await store.get(name, writeinto=buf)
        return buf.getvalue()
    sub = await store._js.pull_subscribe(
        OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=store._name, obj=info.nuid), durable=None,
        stream=OBJ_STREAM_TEMPLATE.format(bucket=store._name),
        config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL,
                              inactive_threshold=PULL_TIMEOUT_S))
    parts: list[bytes] = []
    try:
        while len(parts) < info.chunks:
            msgs = await sub.fetch(batch=min(PULL_BATCH, info.chunks - len(parts)), timeout=PULL_TIMEOUT_S)
            parts.extend(m.data for m in msgs)
    finally:
        await sub.unsubscribe()
    data = b"".join(parts)
    digest = info.digest.replace(OBJ_DIGEST_TYPE, "").replace(OBJ_DIGEST_TYPE.upper(), "")
    if len(data) != info.size or hashlib.sha256(data).digest() != base64.urlsafe_b64decode(digest):
        raise DigestMismatchError
    return data


async def get_manifest(store: Any, object_name: str) -> dict[str, Any]:
    """The manifest exported with ``object_name``; a payload without one is refused."""
    try:
        raw = await get_object(store, manifest_name(object_name))
    except ObjectNotFoundError:
        raise FailedPrecondition(f"weights {object_name!r} have no manifest ({manifest_name(object_name)!r}): "
                                 "cannot tell which base and schema they were trained for",
                                 details={"object_name": object_name}) from None
    try:
        manifest = json.loads(raw)
    except ValueError as exc:
        raise FailedPrecondition(f"manifest of weights {object_name!r} is not JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise FailedPrecondition(f"manifest of weights {object_name!r} is not a JSON object")
    return manifest


def base_identity(key: Any) -> dict[str, Any]:
    """What makes two bases the same for a head: the exact weights and the input layout. The
    compute dtype is left out on purpose: heads read the base's features in float32, so a head
    trained beside a bf16 base (GPU) serves correctly beside the same base in fp32 (CPU)."""
    return {"base_id": key.base_id, "layout": key.layout.to_dict()}


def check_manifest(manifest: dict[str, Any], object_name: str, *, base: str, key: Any, signature: str,
                   adapter: dict[str, Any] | None = None) -> None:
    """Refuse (FailedPrecondition naming both sides) a payload exported for another base or
    another schema than the slot it is about to be loaded into.

    base: the loader's base source (for the message); key: its slot's `CompatibilityKey`;
    signature: the tenant's schema signature; adapter: the tenant's base_adapter ({}: none), which
    the payload's must equal (a LoRA adapter is only meaningful on the base it was trained on,
    which the base check above already proves)."""
    theirs_base = manifest.get("base", "?")
    theirs_key = manifest.get("base_key")
    same_base = theirs_key == key.digest
    if not same_base and isinstance(manifest.get("base_identity"), dict):
        same_base = manifest["base_identity"] == base_identity(key)
    if not same_base:
        raise FailedPrecondition(
            f"weights {object_name!r} were exported for base {theirs_base!r} (key {str(theirs_key)[:19]}), "
            f"not for this base {base!r} (key {key.digest[:19]}): refusing to load them",
            details={"object_name": object_name, "payload_base": theirs_base, "payload_base_key": theirs_key,
                     "base": base, "base_key": key.digest})
    theirs_sig = manifest.get("schema_signature")
    if theirs_sig != signature:
        raise FailedPrecondition(
            f"weights {object_name!r} were exported for schema {str(theirs_sig)[:19]}, not for this tenant's "
            f"schema {signature[:19]}: refusing to load them",
            details={"object_name": object_name, "payload_schema_signature": theirs_sig,
                     "schema_signature": signature})
    theirs_adapter = manifest.get("base_adapter") or {}
    if adapter is not None and theirs_adapter != (adapter or {}):
        raise FailedPrecondition(
            f"weights {object_name!r} carry base_adapter {theirs_adapter or None}, this tenant's is "
            f"{adapter or None}: refusing to load them",
            details={"object_name": object_name, "payload_base_adapter": theirs_adapter, "base_adapter": adapter})
