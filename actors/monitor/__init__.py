"""The monitor's room: the role (`monitor.py`, built from `MonitorConfig`), its retained series
(`series.py`), the Prometheus endpoint (`prom.py`) and per-tenant TensorBoard files
(`boards.py`). Started as ``python -m actors.run monitor``."""
