"""kvstore's version, in a module of its own: the fleet's node records import it without the package's
`__init__` (whose lazy `Client` would make a circle through the fleet client)."""

__version__ = "0.1.0"
