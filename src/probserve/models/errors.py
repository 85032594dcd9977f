"""ModelLoadError: a model that could not be resolved, pulled or loaded, said in one line."""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """A model could not be resolved or loaded; the message is one line, meant for users."""
