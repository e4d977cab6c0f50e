"""Models over the paged KV cache.

    from paged_jax.models import DecoderForCausalLM, init_params, load_hf_checkpoint
    config, params = load_hf_checkpoint(DEFAULT_CHECKPOINT)   # or any HF checkpoint dir

`decoder` (the one Flax decoder of every family, paged forward; `llama` keeps its Llama
names), `dense` (plain-jnp full-recompute forward, the test oracle), `hf_checkpoint`
(safetensors load/save of Llama, Qwen2/2.5, Qwen3, Mistral, Gemma-2, Gemma-3 text
directories), `train` (training loop used by experiments/train_tiny.py).
"""

import os

from paged_jax.models.hf_checkpoint import load_hf_checkpoint, save_hf_checkpoint
from paged_jax.models.decoder import DecoderForCausalLM, init_params, num_params
from paged_jax.models.llama import LlamaForCausalLM

# The shipped byte-level model (see experiments/train_tiny.py, paged_jax/tokenizer.py).
DEFAULT_CHECKPOINT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets",
                                  "tiny_byte_llama")
