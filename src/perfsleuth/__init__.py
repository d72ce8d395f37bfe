"""perfsleuth: a self-hosted performance detective for web services."""

__version__ = "0.1.0"
