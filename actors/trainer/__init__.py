"""The trainer's room: the role (`trainer.py`, built from `TrainerConfig`), its step loop
(`train_loop.py`), the resident LoRA slots (`slots.py`) and data-parallel ranks (`ranks.py`,
the rank processes `rank.py`). Started as ``python -m actors.run trainer``."""
