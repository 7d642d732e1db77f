"""The lorp version, in a module of its own so that any lorp module can record it (stats
files, checkpoint provenance) without importing the `lorp` package from inside itself."""

__version__ = "0.1.0"
