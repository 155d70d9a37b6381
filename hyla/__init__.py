"""hyla: an open stack for hybrid linear-attention language models."""

__version__ = "0.1.0"
