"""``python -m ortmodule.demo --worker MODE WORKDIR``: one run of ``ortmodule demo`` (its child)."""

import sys

from .training import worker

if sys.argv[1:2] == ["--worker"]:
    sys.exit(worker(sys.argv[2:]))
sys.exit("this module is run by `ortmodule demo`; see `ortmodule demo --help`")
