"""Check at import that exactly one build of the training engine is installed."""

from __future__ import annotations

from importlib import metadata

CPU, CUDA, PLAIN = "onnxruntime-training-cpu", "onnxruntime-training", "onnxruntime"


def installed_engines() -> dict[str, str]:
    found = {}
    for dist in (CPU, CUDA, PLAIN, "onnxruntime-gpu"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return found


def engine_problem(found: dict[str, str] | None = None) -> str | None:
    """A message saying what to install or remove, or None when the engine is in order."""
    found = installed_engines() if found is None else found
    training = [d for d in (CPU, CUDA) if d in found]
    if not training:
        extra = ""
        if PLAIN in found or "onnxruntime-gpu" in found:
            extra = " The installed onnxruntime is the inference-only build; uninstall it first."
        return (
            "ORTModule needs ONNX Runtime's training engine and none is installed. Install one: "
            "`pip install 'ortmodule[cpu]'` (onnxruntime-training-cpu) or "
            f"`pip install 'ortmodule[cuda]'` (onnxruntime-training).{extra}"
        )
    if len(training) > 1:
        return (
            f"both {CPU} and {CUDA} are installed; they share one package folder and break each "
            f"other. Keep one: `pip uninstall -y {CPU} {CUDA}` then install `ortmodule[cpu]` or `ortmodule[cuda]`."
        )
    for other in (PLAIN, "onnxruntime-gpu"):
        if other in found:
            return (
                f"{other} is installed next to {training[0]}; they share one package folder. "
                f"Run `pip uninstall -y {other}` and reinstall {training[0]}."
            )
    return None


def check_engine() -> None:
    problem = engine_problem()
    if problem:
        raise ImportError(problem)
