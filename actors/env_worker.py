"""Env worker (Environment Service): simulator sessions and dataset readers (issue 7).

Serves ``<prefix>.env.<op>``; today the runtime's ``info`` and ``drain``.

Run: ``python -m actors.run env --nats-url nats://127.0.0.1:4222``
"""

from __future__ import annotations

from actors.runtime import Role


class EnvWorker(Role):
    name = "env"
