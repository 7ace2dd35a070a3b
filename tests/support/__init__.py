"""Helpers the tests import or start as processes (role stubs, the zygote, fuzzing, queue helpers)."""
