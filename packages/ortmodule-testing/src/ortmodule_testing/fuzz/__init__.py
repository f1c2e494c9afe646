"""A differential fuzzer: random PyTorch programs run in eager and under ORTModule.

    from ortmodule_testing.fuzz import generate_program
    program = generate_program(seed=3)
    print(program.to_source())  # a standalone repro: module, inputs, eager-vs-ORTModule check

``python -m ortmodule_testing.fuzz --programs 1000 --seed 0 --out fuzz-out`` runs many, each in
a child process, and writes a summary and one shrunk repro per failure.
"""

from .generate import Choices, generate, generate_program, replay
from .ops import GenConfig
from .program import Program

__all__ = ["Choices", "GenConfig", "Program", "generate", "generate_program", "replay"]
