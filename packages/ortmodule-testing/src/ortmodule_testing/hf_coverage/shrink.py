"""Shrink any ``transformers`` configuration to a tiny model, generically, by attribute name.

    config = shrink_config(transformers.LlamaConfig)           # hidden 64, 2 layers, 4 heads
    config = shrink_config(transformers.ViTConfig, num_labels=2)

The library default configuration is built first; every size setting it has (under any of the
names models use for it) is replaced, dropouts are set to 0, and the configuration is built
again from those settings, so values a configuration derives in ``__init__`` (such as
``layer_types`` from ``num_hidden_layers``) follow. Nested configurations (``text_config``,
``vision_config``, ...) are shrunk the same way. Raises :class:`NotShrinkable` where the
configuration cannot be built without arguments (a composite that needs its parts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["DROP", "SIZES", "NotShrinkable", "shrink_config", "size_overrides"]

HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
FFN = 128
VOCAB = 128
POSITIONS = 64
IMAGE = 32
PATCH = 8
EXPERTS = 4
SSM_CHUNK = 8  # Mamba-2's chunked scan: shorter than the batches, so state crosses chunks

#: setting name -> tiny value, applied where the default configuration has the name with a
#: value that is not None (None means "derive it", which the model then does from the new sizes)
SIZES: dict[str, int] = {
    # width
    **dict.fromkeys(
        ("hidden_size", "d_model", "n_embd", "n_embed", "d_embed", "embed_dim", "model_dim",
         "word_embed_proj_dim", "embedding_size", "projection_dim", "text_embed_dim"),
        HIDDEN,
    ),
    # depth
    **dict.fromkeys(
        ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers",
         "decoder_layers", "num_decoder_layers", "num_encoder_layers"),
        LAYERS,
    ),
    # attention heads
    **dict.fromkeys(
        ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
         "decoder_attention_heads", "num_decoder_attention_heads"),
        HEADS,
    ),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads"), KV_HEADS),
    "n_groups": KV_HEADS,  # Mamba-2: groups of heads sharing B and C, like key/value heads
    # hybrid Mamba-2 layers (Bamba, FalconH1, GraniteMoeHybrid): few heads, an inner width of
    # twice the hidden size
    "mamba_n_heads": HEADS,
    "mamba_d_ssm": 2 * HIDDEN,
    "mamba_chunk_size": SSM_CHUNK,
    **dict.fromkeys(("head_dim", "d_kv", "attention_head_size", "d_head", "v_head_dim"), HEAD_DIM),
    # multi-head latent attention (DeepSeek-style)
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), 16),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim"), HEAD_DIM // 2),
    "rotary_dim": HEAD_DIM // 2,  # partial rotary embeddings: a part of a head
    # feed-forward
    **dict.fromkeys(
        ("intermediate_size", "ffn_dim", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner",
         "ffn_hidden_size", "inner_hidden_size", "intermediate_dim", "moe_intermediate_size",
         "shared_expert_intermediate_size", "expert_intermediate_size", "mlp_dim"),
        FFN,
    ),
    # mixture of experts: few experts, routing groups that still divide them
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
                    EXPERTS),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "moe_k", "top_k", "num_selected_experts"), 2),
    **dict.fromkeys(("n_group", "topk_group", "n_shared_experts", "num_shared_experts"), 1),
    # vocabulary and positions
    "vocab_size": VOCAB,
    **dict.fromkeys(("max_position_embeddings", "n_positions", "max_seq_len",
                     "max_sequence_length", "n_ctx"), POSITIONS),
    # vision
    "image_size": IMAGE,
    "patch_size": PATCH,
    "num_channels": 3,
    "window_size": 2,  # Swin-style local attention windows that tile the few patches
}  # fmt: skip

#: token ids that index the embedding: kept below the tiny vocabulary
TOKEN_IDS = (
    "pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
    "cls_token_id", "mask_token_id", "unk_token_id", "forced_bos_token_id", "forced_eos_token_id",
)  # fmt: skip
#: per-stage lists of CNN-style and hierarchical vision models: lengths kept, values shrunk
STAGE_LISTS: dict[str, Callable[[int, Any], int]] = {
    "depths": lambda i, v: 1,
    "hidden_sizes": lambda i, v: 16 * 2 ** min(i, 3),
    "embed_dims": lambda i, v: 16 * 2 ** min(i, 3),
    "num_heads": lambda i, v: min(int(v), 2),
    "num_attention_heads": lambda i, v: min(int(v), 2),
}


#: in :func:`size_overrides`' answer: leave this setting out, the configuration derives it
DROP: Any = type("Drop", (), {"__repr__": lambda self: "DROP"})()


class NotShrinkable(Exception):
    """The configuration cannot be built from defaults (the message says why)."""


def _is_config(value: Any) -> bool:
    return hasattr(value, "to_dict") and hasattr(value, "model_type")


def _is_drop_probability(name: str) -> bool:
    """Whether a float setting is the probability of a random drop in training: dropout, and
    also stochastic depth (``drop_path_rate``, ``drop_connect_rate``, ``stochastic_depth_prob``)
    and LayerDrop (``encoder_layerdrop``). Each draws from PyTorch's generator in eager and from
    the engine's under ORTModule, so left on, the two trainings drop different samples or
    layers and part by far more than rounding (ResNet-like vision models with
    ``drop_path_rate=0.1``: FocalNet, BEiT, Data2VecVision, SegFormer)."""
    return "drop" in name or "stochastic_depth" in name


def size_overrides(settings: dict[str, Any], layers_before: int | None = None) -> dict[str, Any]:
    """The tiny settings for a configuration whose ``to_dict()`` is ``settings``.

    Sizes from :data:`SIZES` where the name is present and not None, every float drop
    probability 0 (dropout, drop path, LayerDrop; each element of a per-stage list of them),
    token ids inside the vocabulary, per-stage lists shrunk, per-layer lists dropped so that
    the configuration derives them again.

        size_overrides({"hidden_size": 4096, "attention_dropout": 0.1, "pad_token_id": 50000})
        # {'hidden_size': 64, 'attention_dropout': 0.0, 'pad_token_id': 0}
    """
    out: dict[str, Any] = {}
    for name, value in settings.items():
        if name in SIZES and isinstance(value, int) and not isinstance(value, bool):
            out[name] = SIZES[name]
        elif name in STAGE_LISTS and isinstance(value, (list, tuple)) and value:
            out[name] = [STAGE_LISTS[name](i, v) for i, v in enumerate(value)]
        elif isinstance(value, float) and _is_drop_probability(name):
            out[name] = 0.0
        elif (
            isinstance(value, (list, tuple))
            and value
            and all(isinstance(v, float) for v in value)
            and _is_drop_probability(name)
        ):
            # one probability per stage (CvT: drop_path_rate=(0.0, 0.0, 0.1)): every one off
            out[name] = type(value)(0.0 for _ in value)
        elif name == "dim" and isinstance(value, int) and "hidden_dim" in settings:
            out[name] = HIDDEN  # DistilBERT: dim is the width, hidden_dim the feed-forward
        elif name == "hidden_dim" and isinstance(value, int) and "dim" in settings:
            out[name] = FFN
    vocab = out.get("vocab_size", settings.get("vocab_size"))
    if isinstance(vocab, int):
        for name in TOKEN_IDS:
            value = settings.get(name)
            if isinstance(value, int) and value >= vocab:
                out[name] = min(TOKEN_IDS.index(name), vocab - 1)
            elif isinstance(value, list) and any(isinstance(v, int) and v >= vocab for v in value):
                out[name] = [v for v in value if isinstance(v, int) and v < vocab] or [2]
    if "qk_rope_head_dim" in out and "head_dim" in out:
        # multi-head latent attention: the rotary embedding's head_dim is the rotary part
        out["head_dim"] = out["qk_rope_head_dim"]
    if "expand" in settings and "num_heads" in out and "head_dim" in out:
        # Mamba-2: the heads split the expanded width (num_heads * head_dim == expand * hidden)
        width = out.get("hidden_size", settings.get("hidden_size"))
        if isinstance(width, int) and isinstance(settings["expand"], int):
            out["head_dim"] = width * settings["expand"] // out["num_heads"]
    if "n_groups" in out and isinstance(settings.get("chunk_size"), int):
        out["chunk_size"] = SSM_CHUNK  # Mamba-2 (other models' chunk_size means other things)
    if "mamba_n_heads" in out and isinstance(settings.get("mamba_d_head"), int):
        out["mamba_d_head"] = DROP  # "auto" again: the inner width split among the new heads
    if "kv_lora_rank" in out and "num_key_value_heads" in out:
        out["num_key_value_heads"] = HEADS  # its keys and values have a head per query head
    if "max_position_embeddings" in out and "max_window_layers" in settings:
        out["max_window_layers"] = LAYERS
    if layers_before is not None:
        # per-layer lists (layer_types, sliding-window flags): the configuration rebuilds them
        for name, value in settings.items():
            if isinstance(value, list) and len(value) == layers_before and name not in out:
                out[name] = DROP
    return out


def _layers(settings: dict[str, Any]) -> int | None:
    for name in ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"):
        value = settings.get(name)
        if isinstance(value, int) and value != LAYERS:
            return value
    return None


def _shrunk_settings(config: Any) -> dict[str, Any]:
    settings = {k: v for k, v in vars(config).items() if not k.startswith("_")}
    out = size_overrides(settings, _layers(settings))
    for name, value in settings.items():
        if _is_config(value):
            sub = {k: v for k, v in value.to_dict().items() if not k.startswith("_")}
            sub.update(_shrunk_settings(value))
            out[name] = {k: v for k, v in sub.items() if v is not DROP}
    return out


def shrink_config(config_cls: type, **extra: Any) -> Any:
    """A tiny instance of ``config_cls`` (see the module docstring); ``extra`` settings win."""
    try:
        default = config_cls()
    except Exception as err:  # noqa: BLE001 - any refusal means: no default to shrink
        raise NotShrinkable(
            f"{config_cls.__name__}() needs arguments: {type(err).__name__}: "
            f"{(str(err).splitlines() or [''])[0][:200]}"
        ) from err
    # a per-layer list is not passed at all: the constructor derives it from the new depth
    kwargs = {k: v for k, v in _shrunk_settings(default).items() if v is not DROP}
    kwargs.update(extra)
    return config_cls(**kwargs)
