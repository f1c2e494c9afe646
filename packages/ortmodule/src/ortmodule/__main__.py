"""``ortmodule`` command line: ``ortmodule doctor``, ``ortmodule demo``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ortmodule", description="PyTorch training through ONNX Runtime"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "doctor", help="report versions, the engine build, devices, settings and problems"
    )
    demo = sub.add_parser(
        "demo", help="train a small GPT under eager and under ORTModule, side by side"
    )
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["demo"]:
        from .demo.config import add_arguments

        add_arguments(demo)
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from .doctor import run_doctor

        return run_doctor()
    from .demo.cli import run_demo

    return run_demo(args)


if __name__ == "__main__":
    sys.exit(main())
