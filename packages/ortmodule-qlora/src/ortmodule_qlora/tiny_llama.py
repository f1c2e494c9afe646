"""A tiny QLoRA model for tests, benchmarks and docs: a Hugging Face Llama (random weights, no
download) whose every ``nn.Linear`` is a bitsandbytes ``Linear4bit``, with peft LoRA adapters on
the attention projections. Needs ``transformers`` and ``peft`` (the package's ``test`` extra).

>>> peft_model = qlora_llama("nf4")                       # doctest: +SKIP
>>> ids, mask = batch(0)                                  # doctest: +SKIP
>>> peft_model.base_model.model(input_ids=ids, attention_mask=mask, labels=ids).loss  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ATTENTION_PROJECTIONS", "batch", "causal_mask", "qlora_llama", "to_4bit"]

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def to_4bit(
    model: torch.nn.Module, quant_type: str, *, double_quant: bool = True
) -> torch.nn.Module:
    """Replace every ``nn.Linear`` of ``model`` by a frozen ``bnb.nn.Linear4bit`` with its weights."""
    import bitsandbytes

    nn: Any = bitsandbytes.nn  # untyped library
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            q = nn.Linear4bit(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                quant_type=quant_type,
                compress_statistics=double_quant,
            )
            q.weight = nn.Params4bit(
                child.weight.data.clone(),
                requires_grad=False,
                quant_type=quant_type,
                compress_statistics=double_quant,
            )
            if child.bias is not None:
                q.bias = torch.nn.Parameter(child.bias.data.clone(), requires_grad=False)
            setattr(module, name, q.to(child.weight.device))  # .to() quantizes
    return model


def qlora_llama(
    quant_type: str = "nf4",
    *,
    hidden: int = 64,
    layers: int = 2,
    vocab: int = 128,
    rank: int = 4,
    seed: int = 0,
    input_require_grads: bool = True,
) -> Any:
    """A peft model: 4-bit Llama, LoRA (rank ``rank``, non-zero init) on the attention projections.

    ``enable_input_require_grads()`` is on by default, as peft's ``prepare_model_for_kbit_training``
    sets it, so every 4-bit matmul runs through bitsandbytes' ``MatMul4Bit``. Off, the first
    layer's projections get an input that needs no gradient and bitsandbytes calls its
    ``gemm_4bit`` operator for them.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        use_cache=False,
        tie_word_embeddings=False,
    )
    base = to_4bit(LlamaForCausalLM(config), quant_type)
    lora = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=0.0,
        target_modules=list(ATTENTION_PROJECTIONS),
        # peft's default zero-initialises B, making the first gradients of A zero: a weak test
        init_lora_weights=False,
    )
    peft_model = get_peft_model(base, lora)
    if input_require_grads:
        peft_model.enable_input_require_grads()
    return peft_model


def causal_mask(batch_size: int, seq: int) -> torch.Tensor:
    """An explicit 4-D float causal mask (0 where attention is allowed, float32 min elsewhere).

    Passing it keeps transformers from building the mask from a bool ``cumsum``, which the
    engine's ``CumSum`` cannot take.
    """
    full = torch.full((seq, seq), torch.finfo(torch.float32).min).triu(1)
    return full[None, None].expand(batch_size, 1, seq, seq).contiguous()


def batch(
    step: int, batch_size: int = 2, seq: int = 16, vocab: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (also the labels) and the causal mask for ``step``, reproducible."""
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (batch_size, seq), generator=gen)
    return ids, causal_mask(batch_size, seq)
