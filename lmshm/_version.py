"""lmshm's release (``lmshm.__version__``), in a module of its own that imports nothing, so
that every layer may read it without importing the package's lazy public names."""

__version__ = "0.1.0"
