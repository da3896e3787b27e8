"""Exceptions raised by the models package (request-level problems become error results, not exceptions)."""

from __future__ import annotations


class ModelLoadError(Exception):
    """The model directory cannot be loaded: the message says what is wrong and what to change."""
