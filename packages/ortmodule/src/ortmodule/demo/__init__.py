"""``ortmodule demo``: train a small GPT under PyTorch eager and under ORTModule, side by side.

The model (:class:`DemoGPT`, in ``model.py``) is trained on the text shipped in
``ortmodule/demo_data/`` with a character tokenizer, so the demo downloads nothing. Both runs
start from the same initial weights and see the same batches; each runs in a fresh Python
process, so its peak memory is its own. At the end the demo prints a side-by-side table, writes
the loss curves to a PNG and lets the ORTModule model write a few lines of text.

    ortmodule demo                                  # the defaults: about a minute or two on 2 cores
    ortmodule demo --steps 20 --out /tmp/demo       # a quick look
    python -m ortmodule demo --save-onnx            # also keep the exported and built ONNX models

``run_demo(args)`` is what ``ortmodule demo`` calls; ``python -m ortmodule.demo --worker`` is the
per-run child process it starts, not a command for users.

One module per part: ``config`` (options), ``data`` (corpus, tokenizer, batches), ``model``
(the GPT, sampling), ``progress`` (the progress bar), ``training`` (one run in its own
process), ``report`` (table, speed sentence, plots) and ``cli`` (``run_demo``).
"""

from __future__ import annotations

from .cli import run_demo
from .config import DemoConfig, add_arguments
from .data import CharTokenizer, load_corpus, make_batches
from .model import DemoGPT
from .progress import ProgressBar
from .training import RunResult

__all__ = [
    "CharTokenizer",
    "DemoConfig",
    "DemoGPT",
    "ProgressBar",
    "RunResult",
    "add_arguments",
    "load_corpus",
    "make_batches",
    "run_demo",
]
