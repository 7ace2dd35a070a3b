"""Benchmarks (run as scripts or `python -m bench.<name>`); not timed tests."""
