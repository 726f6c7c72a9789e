"""The package's version (setup.cfg's `version`), in a module of its own so that any module can read it without
importing the package's top level."""

__version__ = "0.1.0"
