"""vla-nexus SDK: `Client` (sync) and `AsyncClient` (async). See sdk/client.py."""

from sdk.client import AsyncClient, Client, resolve_cluster

__all__ = ["AsyncClient", "Client", "resolve_cluster"]
