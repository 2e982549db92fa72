"""Executor errors: one root, specific subclasses, each knowing whether a retry could help."""

from __future__ import annotations


class ExecutorError(Exception):
    """Root of every error the executor raises itself."""

    retryable = False


class SetupError(ExecutorError):
    """The executor cannot start: a binary or directory it needs is missing or unusable."""


class IsolationError(SetupError):
    """The isolation asked for cannot be had on this machine."""


class StepFailed(ExecutorError):
    """A step of a phase failed; the run fails with `reason` and Terraform's `message`.

    `error` is what the step's `FinishStep` records (the diagnostics, else the output's
    last lines); `message` is what the run's `FailRun` records.
    """

    def __init__(self, step: str, message: str, *, reason: str = "", error: str = "") -> None:
        super().__init__(f"{step} failed: {message}")
        self.step = step
        self.message = message
        self.reason = reason or f"{step}_failed"
        self.error = error or message


class ObjectStoreError(ExecutorError):
    """Reading or writing an object-store object failed (NATS unreachable, bad digest)."""

    retryable = True
