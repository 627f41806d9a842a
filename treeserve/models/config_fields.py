"""Which `config.json` fields each supported family reads, which it may ignore, and which it refuses.

A field that changes a model's arithmetic is either implemented (`READ`) or refused at load
unless it holds its no-op value (`REFUSED`), so no checkpoint loads silently wrong. `INERT`
fields change nothing at inference (training knobs, metadata, label names). A field in none of
these is logged as unknown; in a MoE config an unknown expert or router field is refused, since
routing has no safe default. tests/models/test_config_fields.py walks every field transformers
writes for each family and proves it is in one of these sets.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

INERT = {
    "_name_or_path",
    "architectures",
    "attention_dropout",
    "auto_map",
    "chunk_size_feed_forward",
    "dtype",
    "embd_pdrop",
    "id2label",
    "initializer_range",
    "label2id",
    "model_type",
    "num_labels",
    "output_attentions",
    "output_hidden_states",
    "output_router_logits",
    "pad_token_id",
    "pretraining_tp",
    "problem_type",
    "resid_pdrop",
    "return_dict",
    "router_aux_loss_coef",
    "tokenizer_class",
    "torch_dtype",
    "transformers_version",
    "use_cache",
    "classifier_dropout",
    "token_classification_bias",  # a reward head's: the PRM adapters read its tensors
    "quantization_config",  # read (or refused) by models/quantized_checkpoint.py, not by the model's config
}
# pretraining_tp splits Llama's matmuls into slices summed again: the same products in another order.

_LLAMA = {
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "hidden_act",
    "eos_token_id",
    "bos_token_id",
}
_QWEN_WINDOWS = {"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"}
READ = {
    "llama": _LLAMA,
    "mistral": _LLAMA | {"sliding_window"},
    "qwen2": _LLAMA | _QWEN_WINDOWS,
    "qwen3": _LLAMA | _QWEN_WINDOWS,
    "qwen3_moe": _LLAMA
    | _QWEN_WINDOWS
    | {
        "decoder_sparse_step",
        "mlp_only_layers",
        "moe_intermediate_size",
        "norm_topk_prob",
        "num_experts_per_tok",
        "num_experts",
        "num_local_experts",
    },
    "phi3": _LLAMA | {"sliding_window", "original_max_position_embeddings", "partial_rotary_factor"},
    "gemma3_text": _LLAMA
    | {
        "hidden_activation",
        "layer_types",
        "query_pre_attn_scalar",
        "rope_local_base_freq",
        "sliding_window",
        "sliding_window_pattern",
        "_sliding_window_pattern",
    },
}

# field -> (the value that changes nothing, why another value is refused)
REFUSED = {
    "is_encoder_decoder": (False, "encoder-decoder models are not supported: treeserve runs causal decoders"),
    "use_bidirectional_attention": (False, "bidirectional attention is not supported: treeserve runs causal decoders"),
    "attn_logit_softcapping": (None, "attention logit soft-capping is not implemented"),
    "final_logit_softcapping": (None, "final logit soft-capping is not implemented"),
}
_MOE_WORDS = ("expert", "moe", "router", "routed", "topk", "top_k")


def check_fields(cfg: dict, model_type: str) -> None:
    """Refuse a field of `cfg` (a `model_type` config.json) that would change the arithmetic and is
    not implemented, naming it; log fields this module has never heard of."""
    for field, (noop, why) in REFUSED.items():
        value = cfg.get(field)
        if value is not None and value != noop and value != {}:
            detail = f"quant_method {value.get('quant_method')!r}" if isinstance(value, dict) else repr(value)
            raise ValueError(f"config.json field {field}={detail}: {why.format(detail)}")
    known = READ.get(model_type, set()) | INERT | set(REFUSED)
    unknown = sorted(set(cfg) - known)
    if model_type == "qwen3_moe":
        moe = [f for f in unknown if any(word in f for word in _MOE_WORDS) and cfg[f] not in (None, False, 0, [])]
        if moe:
            raise ValueError(f"qwen3_moe config fields {moe} are not implemented: refused, not run approximately")
    if unknown:
        log.warning("config.json fields treeserve does not read for %s: %s", model_type, unknown)
