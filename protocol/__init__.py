"""The wire contract of vla-nexus: names, codec, messages, errors.

- `protocol.subjects.Names`: every subject, stream, KV and object bucket name.
- `protocol.codec`: msgpack with numpy / torch ext types; never pickle.
- `protocol.wire`: typed messages (kind + schema version) with strict decoding.
- `protocol.messages`: every message type.
- `protocol.errors`: the exception root and stable error codes.
"""

from protocol.errors import ErrorCode, NexusError
from protocol.subjects import DEFAULT_PREFIX, ROLES, Names
from protocol.wire import decode, encode

__all__ = ["DEFAULT_PREFIX", "ROLES", "ErrorCode", "Names", "NexusError", "decode", "encode"]
