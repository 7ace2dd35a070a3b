"""vla-nexus SDK: `Client` (sync, sdk/sync_client.py) and `AsyncClient` (async, sdk/client.py)."""

__all__ = ["AsyncClient", "Client", "resolve_cluster"]


def __getattr__(name: str):
    # Imported on first use (PEP 562): `python -m sdk.cli` imports this package first, and
    # `nexus spec validate` must not pay for the NATS client and OpenTelemetry.
    if name in __all__:
        if name == "Client":
            from sdk import sync_client as module
        else:
            from sdk import client as module

        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sdk' has no attribute {name!r}")
