"""Inferencer (Inference Model Service): group-batched predict (issue 5 fills it in).

Serves ``<prefix>.inferencer.<op>``; today the runtime's ``info`` and ``drain``.

Run: ``python -m actors.run inferencer --nats-url nats://127.0.0.1:4222``
"""

from __future__ import annotations

from actors.runtime import Role


class Inferencer(Role):
    name = "inferencer"
