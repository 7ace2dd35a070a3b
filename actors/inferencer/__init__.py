"""The inferencer's room: the role (`inferencer.py`, built from `InferencerConfig`), its
batching and forward helpers (`batching.py`), the served adapter heads (`serving.py`), and the
per-tenant rate limit and reply cache it alone uses. Started as ``python -m actors.run inferencer``."""
