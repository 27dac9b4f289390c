"""The package version: a leaf module, so graph files record it without importing the package."""

__version__ = "0.1.0"
