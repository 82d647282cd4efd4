"""The source of truth for the client and the SQL store. ``permits._sync`` is generated from this package
by scripts/unasync.py; the test suite fails when the two drift apart."""
