"""kiln's version (a leaf: the package and the HTTP app both read it)."""

__version__ = "0.1.0"
