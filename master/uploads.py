"""Starting weights a tenant uploads, and the start of a tenant's slot from them (issue 30).

    nexus --creds T.creds weights upload head ./acme-v12.safetensors
    # spec:  init: {weights: head}            (adapter: NAME for a separate peft adapter file)

`weights_upload` takes a file in slices (`WeightsUploadRequest`) into a staging file under the
master's data dir, ``<data>/uploads/<tenant>/<name>.part``; the last slice checks it is a
safetensors file (header, dtypes, offsets) and stores it as the object
``<tenant>/upload-<name>`` in the weights bucket, then removes the staging file. Nothing else
is written: a refused or abandoned upload leaves no object (a later upload of the name starts
the staging file again). Names are tokens (`[A-Za-z0-9_-]{1,64}`: no path), the tenant is the
caller's own (the op's ``tenant`` access), files are at most `MAX_UPLOAD_BYTES` and a tenant
keeps at most `MAX_UPLOADS_PER_TENANT` names.

At submit a spec's ``init`` names uploads; they are resolved in the submitting tenant's own
area only (``<tenant>/upload-<name>``: another tenant's uploads cannot be named) and a trainer
(`init_weights`) loads them into the new slot, checking every tensor against the spec's
shapes, and exports the result as the tenant's version 0, which trainers and inferencers
then start from (actors/trainer/slots.py, actors/inferencer/serving.py).
"""

from __future__ import annotations

import contextlib

import json
import struct
from pathlib import Path
from typing import Any

from nats.js.errors import NotFoundError, ObjectNotFoundError

from transport.bus import js_retry
from actors.runtime import op
from protocol import ops
from protocol.errors import CapacityExceeded, InvalidField, NotFound
from protocol.messages import Ok, WeightsChunk, WeightsReadRequest, WeightsUploadRequest
from protocol.policy import MAX_UPLOAD_BYTES, MAX_UPLOADS_PER_TENANT
from protocol.subjects import check_token
from master.state import MasterState
from master.tenant_checks import schema_signature

UPLOAD_PREFIX = "upload-"
# safetensors' own dtype names (the ones torch's safetensors writes).
SAFETENSORS_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1}
# A safetensors header is JSON of a few KB per hundred tensors; beyond this it is not one of ours.
MAX_HEADER_BYTES = 16 * 2**20


def upload_object(tenant: str, name: str) -> str:
    """The object an upload of ``tenant`` named ``name`` is stored as (both checked tokens)."""
    check_token("tenant", tenant)
    check_token("name", name)
    return f"{tenant}/{UPLOAD_PREFIX}{name}"


def safetensors_shapes(data: bytes, what: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor: (dtype, shape)} of a safetensors file, or InvalidField naming ``what`` and why
    it is not one (no torch: the master checks every upload before storing it)."""
    def bad(why: str) -> InvalidField:
        return InvalidField(what, f"not a safetensors file: {why}; upload a .safetensors file (a policy from "
                                  "`nexus download`, or a peft adapter_model.safetensors)")

    if len(data) < 8:
        raise bad(f"{len(data)} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", data[:8])
    if n > min(MAX_HEADER_BYTES, len(data) - 8):
        raise bad(f"header length {n} is past the file's {len(data)} bytes")
    try:
        header = json.loads(data[8:8 + n])
    except (UnicodeDecodeError, ValueError):
        raise bad("the header is not JSON") from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    body = len(data) - 8 - n
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(entry, dict) or entry.get("dtype") not in SAFETENSORS_DTYPES:
            raise bad(f"tensor {key!r} has no known dtype (allowed: {', '.join(SAFETENSORS_DTYPES)})")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) for o in offsets)):
            raise bad(f"tensor {key!r} has no valid shape / data_offsets")
        count = 1
        for d in shape:
            count *= d
        lo, hi = offsets
        if not 0 <= lo <= hi <= body or hi - lo != count * SAFETENSORS_DTYPES[entry["dtype"]]:
            raise bad(f"tensor {key!r}'s data_offsets {offsets} do not hold its {entry['dtype']} shape {shape} "
                      f"inside the {body}-byte body")
        out[key] = (entry["dtype"], tuple(shape))
    if not out:
        raise bad("it holds no tensors")
    return out


# Whole objects `weights_read` keeps between slices (a payload and its manifest, twice over).
WEIGHTS_READ_CACHE = 4


class UploadOps:
    """The master's part for weights in and out: ``weights_upload``, the spec's ``init``
    names, and ``weights_read``."""

    def __init__(self, st: MasterState) -> None:
        self.st = st
        self._read_cache: dict[str, bytes] = {}  # object name -> bytes, oldest first (weights_read)

    def _upload_dir(self, tenant: str) -> Path:
        check_token("tenant", tenant)
        return Path(self.st.cfg.data_dir).resolve() / "uploads" / tenant

    async def _weights_store(self) -> Any:
        return await js_retry(self.st.bus.js.object_store, self.st.names.obj_weights)

    async def _uploads_of(self, tenant: str) -> set[str]:
        store = await self._weights_store()
        try:
            infos = await store.list(ignore_deletes=True)
        except NotFoundError:
            return set()
        head = f"{tenant}/{UPLOAD_PREFIX}"
        return {i.name[len(head):] for i in infos if i.name.startswith(head)}

    @op(ops.MASTER_WEIGHTS_UPLOAD)
    async def weights_upload(self, req: WeightsUploadRequest) -> Ok:
        check_token("name", req.name)  # a token: never a path ('../x', 'a/b' are refused here)
        obj = upload_object(req.tenant, req.name)
        end = req.offset + len(req.data)
        if end > MAX_UPLOAD_BYTES:
            raise InvalidField("file", f"{end} bytes or more, past the largest upload of {MAX_UPLOAD_BYTES} bytes "
                                       f"({MAX_UPLOAD_BYTES // 2**20} MiB): upload the action module and "
                                       "adapter only, never the base")
        folder = self._upload_dir(req.tenant)
        part = folder / f"{req.name}.part"
        if req.offset == 0:
            # Stored names and staged ones (an upload left unfinished): both hold the tenant's
            # disk, so both count against its bound.
            staged = {p.name[:-5] for p in folder.glob("*.part")} if folder.is_dir() else set()
            kept = await self._uploads_of(req.tenant) | staged
            if req.name not in kept and len(kept) >= MAX_UPLOADS_PER_TENANT:
                raise CapacityExceeded(f"tenant {req.tenant!r} keeps {len(kept)} uploads, the most allowed "
                                       f"({MAX_UPLOADS_PER_TENANT}); upload under a kept name to replace it",
                                       details={"limit": MAX_UPLOADS_PER_TENANT, "value": len(kept)})
            folder.mkdir(parents=True, exist_ok=True)
            part.unlink(missing_ok=True)
            part.touch()
        have = part.stat().st_size if part.is_file() and not part.is_symlink() else -1
        if have != req.offset:
            raise InvalidField("offset", f"{req.offset}, but {max(have, 0)} bytes of upload {req.name!r} are staged; "
                                         "start again from offset 0")
        with part.open("ab") as f:
            f.write(req.data)
        if not req.final:
            return Ok(detail=f"{end} bytes staged")
        try:
            data = part.read_bytes()
            tensors = safetensors_shapes(data, "file")
            await js_retry((await self._weights_store()).put, obj, data)
        finally:
            part.unlink(missing_ok=True)  # stored or refused: no staging file stays
            with contextlib.suppress(OSError):
                folder.rmdir()  # nor the tenant's staging folder, unless other uploads are staged there
        return Ok(detail=f"uploaded {req.name}: {len(tensors)} tensors, {len(data)} bytes")

    async def resolve_init(self, tenant: str, init: Any) -> tuple[str, str]:
        """(weights object, adapter object or "") of a spec's ``init``: each name looked up in
        ``tenant``'s own uploads only; one that is not there is an error naming its field."""
        store = await self._weights_store()
        out = []
        for field, name in (("init.weights", init.weights), ("init.adapter", init.adapter)):
            if not name:
                out.append("")
                continue
            obj = upload_object(tenant, name)
            try:
                await js_retry(store.get_info, obj)
            except (ObjectNotFoundError, NotFoundError):
                raise NotFound(f"{field}: tenant {tenant!r} has no upload named {name!r}; upload it first with "
                               f"`nexus weights upload {name} FILE`", details={"field": field, "name": name}) from None
            out.append(obj)
        return out[0], out[1]

    async def start_from_upload(self, cfg: Any, init: Any) -> str:
        """A trainer checks ``init``'s uploads against ``cfg`` (the new tenant's compiled spec)
        and writes them as its version 0 export; returns that object's name. Its refusal (a
        tensor of another shape, one missing or unknown, a name not uploaded) is the submit's."""
        from msgspec.structs import replace

        from transport.weights import weights_name
        from protocol.messages import InitWeightsRequest
        from protocol.policy import INIT_WEIGHTS_TIMEOUT_S

        weights, adapter = await self.resolve_init(cfg.name, init)
        req = InitWeightsRequest(config=replace(cfg, signature=schema_signature(cfg.schema)), weights=weights,
                                 adapter=adapter)
        await self.st.bus.call(ops.TRAINER_INIT_WEIGHTS, req,
                            timeout_s=INIT_WEIGHTS_TIMEOUT_S)
        return weights_name(cfg.name, 0)

    async def drop_start(self, tenant: str) -> None:
        """The tenant was not created after all: its version 0 export goes (best effort)."""
        from transport.weights import manifest_name, weights_name

        store = await self._weights_store()
        for name in (weights_name(tenant, 0), manifest_name(weights_name(tenant, 0))):
            try:
                await store.delete(name)
            except (ObjectNotFoundError, NotFoundError):
                pass
        try:
            await self.st.kv_versions.delete(tenant)
        except NotFoundError:
            pass

    @op(ops.MASTER_WEIGHTS_READ)
    async def weights_read(self, req: WeightsReadRequest) -> WeightsChunk:
        """A slice of a tenant's exported policy (or its manifest): the download path of a
        client without JetStream. The whole object is read, and the last few kept, so a
        download in slices reads it from the store once."""
        from transport.weights import manifest_name, weights_name

        assert self.st.bus is not None
        version = self.st.sched.versions.get(req.tenant, 0) if req.version < 0 else req.version
        if version <= 0:
            raise NotFound(f"tenant {req.tenant!r} has no exported version yet", details={"tenant": req.tenant})
        name = weights_name(req.tenant, version)
        name = manifest_name(name) if req.manifest else name
        data = self._read_cache.get(name)
        if data is None:
            store = await js_retry(self.st.bus.js.object_store, self.st.names.obj_weights)
            try:
                data = (await store.get(name)).data or b""
            except ObjectNotFoundError:
                raise NotFound(f"tenant {req.tenant!r} has no version {version}",
                               details={"tenant": req.tenant, "version": version}) from None
            self._read_cache[name] = data
            while len(self._read_cache) > WEIGHTS_READ_CACHE:
                self._read_cache.pop(next(iter(self._read_cache)))
        return WeightsChunk(tenant=req.tenant, version=version, object_name=name, offset=req.offset,
                            total=len(data), data=data[req.offset:req.offset + req.max_bytes])
