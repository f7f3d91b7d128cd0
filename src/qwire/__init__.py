"""qwire: fewer bits on the wire for distributed training over slow networks."""

__version__ = "0.1.0"
