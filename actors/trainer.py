"""Trainer (Training Model Service): resident base plus tenant slots (issue 4 fills it in).

Serves ``<prefix>.trainer.<op>``; today the runtime's ``info`` and ``drain``.

Run: ``python -m actors.run trainer --nats-url nats://127.0.0.1:4222``
"""

from __future__ import annotations

from actors.runtime import Role


class Trainer(Role):
    name = "trainer"
