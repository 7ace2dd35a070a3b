"""The health manager's room: the role (`health.py`, built from `HealthConfig`) and the scaler
policy it runs on the heartbeats (`scaler.py`). Started as ``python -m actors.run health``."""
