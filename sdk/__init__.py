"""vla-nexus SDK: `Client` (sync) and `AsyncClient` (async). See sdk/client.py."""

__all__ = ["AsyncClient", "Client", "resolve_cluster"]


def __getattr__(name: str):
    # Imported on first use (PEP 562): `python -m sdk.cli` imports this package first, and
    # `nexus spec validate` must not pay for the NATS client and OpenTelemetry.
    if name in __all__:
        from sdk import client

        value = getattr(client, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sdk' has no attribute {name!r}")
