"""Exceptions raised by the models package (request-level problems become error results, not exceptions)."""

from __future__ import annotations


class ModelLoadError(Exception):
    """The model directory cannot be loaded: the message says what is wrong and what to change."""


class DeviceLostError(Exception):
    """The accelerator cannot run anything any more (the CUDA context is gone after a kernel fault).

    Nothing scored after this is trustworthy: the process must stop and be restarted.
    """
