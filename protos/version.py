"""The protocol version. SPEC.md states the same number; tests/test_spec.py keeps them in step."""

PROTOCOL_VERSION = 5
