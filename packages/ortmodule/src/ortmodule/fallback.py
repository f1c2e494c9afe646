"""Fallback to PyTorch when the engine cannot run the model (``ORTMODULE_FALLBACK_POLICY``).

Each failure is classified into one policy flag. When the active policy holds that flag,
training continues in PyTorch after one WARNING that names the cause and how to make it an
error; otherwise the original error surfaces. With ``ORTMODULE_FALLBACK_RETRY=1`` the next call
tries the engine again instead of staying in PyTorch.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ortmodule_exporter import EngineBuildError, ExportError

from .execution import UnsupportedDataError, UnsupportedDeviceError
from .options import FallbackPolicy, RuntimeOptions


class InitializationError(RuntimeError):
    """Something other than export or the graph build failed while setting up the engine."""


def classify(err: BaseException) -> FallbackPolicy:
    """The policy flag that covers ``err``."""
    if isinstance(err, UnsupportedDeviceError):
        return FallbackPolicy.FALLBACK_UNSUPPORTED_DEVICE
    if isinstance(err, UnsupportedDataError):
        return FallbackPolicy.FALLBACK_UNSUPPORTED_DATA
    if isinstance(err, ExportError):
        return FallbackPolicy.FALLBACK_UNSUPPORTED_TORCH_MODEL
    if isinstance(err, EngineBuildError):
        return FallbackPolicy.FALLBACK_UNSUPPORTED_ONNX_MODEL
    return FallbackPolicy.FALLBACK_BAD_INITIALIZATION


_RECOGNISED = (
    FallbackPolicy.FALLBACK_UNSUPPORTED_DEVICE
    | FallbackPolicy.FALLBACK_UNSUPPORTED_DATA
    | FallbackPolicy.FALLBACK_UNSUPPORTED_TORCH_MODEL
    | FallbackPolicy.FALLBACK_UNSUPPORTED_ONNX_MODEL
)


class FallbackManager:
    """Decides, per call, whether PyTorch runs the module instead of the engine."""

    def __init__(self, options: RuntimeOptions, module: torch.nn.Module) -> None:
        self.policy = options.fallback_policy
        self.retry = options.fallback_retry
        self.module = module
        #: the error that made us fall back, when we did
        self.cause: BaseException | None = None

    @property
    def forced(self) -> bool:
        return bool(self.policy & FallbackPolicy.FALLBACK_FORCE_TORCH_FORWARD)

    def covers(self, flag: FallbackPolicy) -> bool:
        """Whether the policy lets a failure of kind ``flag`` fall back to PyTorch.

        ``FALLBACK_FORCE_TORCH_BACKWARD`` is the original ORTModule's catch-all over the
        failures ORTModule recognises (device, data, PyTorch model, ONNX model): it does not
        move anything to PyTorch by itself; a model the engine runs stays in the engine.
        """
        if self.policy & FallbackPolicy.FALLBACK_DISABLE:
            return False
        if self.policy & FallbackPolicy.FALLBACK_FORCE_TORCH_BACKWARD and flag & _RECOGNISED:
            return True
        return bool(self.policy & flag)

    def use_torch(self) -> bool:
        if self.forced:
            return True
        return self.cause is not None and not self.retry

    def handle(self, err: BaseException, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        flag = classify(err)
        if not self.covers(flag):
            raise err
        first = self.cause is None
        self.cause = err
        if first:
            what = type(self.module).__module__ + "." + type(self.module).__qualname__
            message = (
                f"ORTModule could not run {what} in ONNX Runtime ({flag.name}): {_first_line(err)}. "
                "Training continues in PyTorch. To make this an error, set "
                "ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE."
            )
            warnings.warn(message, UserWarning, stacklevel=5)  # the user's model(...) line
        return self.module(*args, **kwargs)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
