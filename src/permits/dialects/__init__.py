"""All SQL lives in this package: one module per database, statements by name."""

from permits.dialects.base import Dialect, Fault, dialect_for_url

__all__ = ["Dialect", "Fault", "dialect_for_url"]
