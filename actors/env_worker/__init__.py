"""The env worker's room: the role (`env_worker.py`, built from `EnvWorkerConfig`) that hosts
simulator sessions and runs submitted workflows. Started as ``python -m actors.run env``."""
