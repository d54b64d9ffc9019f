"""An extension module that registers no archetype (tests/test_extensions.py: a clear error)."""

VALUE = 1
