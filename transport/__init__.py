"""The transport floor: what the roles (actors/) and the SDK (sdk/) both need to talk to a
deployment, below both: the bus, credentials and accounts, trace context in headers, the
stream and bucket layout, and cluster.json. Imports only protocol/, envs/, models/ and itself."""
