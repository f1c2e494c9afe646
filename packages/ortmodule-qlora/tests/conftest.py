"""Every QLoRA test runs with the component registered, as ORTModule would register it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("bitsandbytes")

from ortmodule_exporter.components import register_component  # noqa: E402
from ortmodule_exporter.python_op import enable_custom_autograd  # noqa: E402
from ortmodule_exporter.python_op.runner import install as install_python_op_runners  # noqa: E402
from ortmodule_qlora import COMPONENT, use_matmul_bnb4  # noqa: E402


@pytest.fixture(autouse=True)
def _component() -> Iterator[None]:
    enable_custom_autograd(True)  # ORTModule's default (ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=1)
    # as ORTModule does: the runners also register the exit hook that drops the Functions an
    # exported PythonOp handed to the engine (without it the interpreter crashes at exit)
    install_python_op_runners()
    register_component(COMPONENT)
    use_matmul_bnb4(True)
    yield
    use_matmul_bnb4(True)
