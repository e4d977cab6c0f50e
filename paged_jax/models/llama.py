"""Llama names for the one decoder (models/decoder.py), kept for existing callers.

`LlamaForCausalLM` is `decoder.DecoderForCausalLM`: it runs every supported family (Llama,
Qwen2 / Qwen2.5, Qwen3, Mistral, Gemma-2, Gemma-3 text) as its ModelConfig says.
"""

from paged_jax.models.decoder import (  # pylint: disable=unused-import
    DecoderAttention as LlamaAttention,
    DecoderForCausalLM as LlamaForCausalLM,
    DecoderLayer as LlamaDecoderLayer,
    DecoderMLP as LlamaMLP,
    DecoderModel as LlamaModel,
    RMSNorm,
    apply_rope,
    init_params,
    num_params,
    rope_cos_sin,
)
