"""The package version, in one place: ``pyproject.toml`` reads it statically (``[tool.setuptools.dynamic]``),
``sanitizer.__version__`` and ``ownsan --version`` import it. Standard library only, nothing else here."""

__version__ = "0.1.0"
