"""Dev-only test support for ORTModule: the model zoo and the PyTorch-eager parity harness.

    from ortmodule_testing.parity import assert_same_training, clone_model, train_steps
    from ortmodule_testing.zoo import ZOO

Importing it imports torch and the standard library only (no pytest, onnx or onnxruntime).
"""

__version__ = "0.1.0"
