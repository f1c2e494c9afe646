"""The model zoo shared by the exporter, the runtime, the optimizer and the benchmarks.

Plain PyTorch models of the kinds users train, each deterministic under ``torch.manual_seed``
and exportable with the TorchScript ONNX exporter in training mode. :data:`ZOO` names the small
configurations the parity tests train; :func:`gpt_benchmark`, :func:`bert_benchmark` and
:func:`masked_lm_benchmark` give the benchmark sizes.

    from ortmodule_testing.zoo import ZOO

    for case in ZOO.values():
        model = case.build(seed=0)
        args, kwargs = case.make_batch(0)
        case.loss_fn(model(*args, **kwargs), args, kwargs).backward()
"""

from ortmodule_testing.zoo.bert import BertConfig, BertEncoder
from ortmodule_testing.zoo.cnn import CNN
from ortmodule_testing.zoo.dict_io import DictIOModel, DictIOOutput
from ortmodule_testing.zoo.frozen import FrozenSubmoduleModel
from ortmodule_testing.zoo.gpt import GPTConfig, GPTDecoder
from ortmodule_testing.zoo.loss_only import LossOnly
from ortmodule_testing.zoo.mlp import MLP
from ortmodule_testing.zoo.model_output import ModelOutput
from ortmodule_testing.zoo.non_tensor_args import NonTensorArgsModel
from ortmodule_testing.zoo.registry import (
    ZOO,
    Batch,
    BatchFn,
    LossFn,
    ZooCase,
    bert_benchmark,
    gpt_benchmark,
    masked_lm_benchmark,
)

__all__ = [
    "CNN",
    "MLP",
    "ZOO",
    "Batch",
    "BatchFn",
    "BertConfig",
    "BertEncoder",
    "DictIOModel",
    "DictIOOutput",
    "FrozenSubmoduleModel",
    "GPTConfig",
    "GPTDecoder",
    "LossFn",
    "LossOnly",
    "ModelOutput",
    "NonTensorArgsModel",
    "ZooCase",
    "bert_benchmark",
    "gpt_benchmark",
    "masked_lm_benchmark",
]
