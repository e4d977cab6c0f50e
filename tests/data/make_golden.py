"""Writes the golden fixtures of tests/hf_golden_test.py with transformers' own classes.

    /work/venvs/hf/bin/python tests/data/make_golden.py       # needs torch + transformers

For each family in FAMILIES: a tiny random checkpoint written by transformers'
`save_pretrained` (fp32 safetensors + config.json) into tests/data/hf_golden/<family>/, and
`golden.json` beside it: the 3 prompts, transformers' greedy tokens for MAX_TOKENS steps (full
recomputation every step, eager attention), the last step's logits, a checksum of every
step's logits, and the smallest top-1 / top-2 logit gap met (so a test knows its margin).
Weights are refilled with O(1) random values (seeded) so every part of the model matters
and logits are well separated; the configs shrink windows, soft caps and RoPE bases so a
32-token decode crosses every feature (sliding windows of 8, caps that bend the scores).
The Gemma fixtures are untied: a tied random Gemma greedily repeats one token (its
normalised residual stays closest to one embedding row), which would test little; the
tied path is covered by the Qwen fixtures.

tests/hf_families_test.py imports this module to run the same comparison against the
installed transformers (slow tier).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "hf_golden")
MAX_TOKENS = 32
SEED = 0
_SHAPE = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=8,
              max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)

# family (= HF model_type) -> (config class, config.json keys beyond _SHAPE)
FAMILIES = {
    "llama": ("LlamaConfig", dict(
        attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", dict(sliding_window=8, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=8,
                                  max_window_layers=1, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0})),
    "gemma2": ("Gemma2Config", dict(
        sliding_window=8, query_pre_attn_scalar=32, attn_logit_softcapping=5.0,
        final_logit_softcapping=8.0, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0})),
    "gemma3_text": ("Gemma3TextConfig", dict(
        sliding_window=8, query_pre_attn_scalar=12, final_logit_softcapping=8.0,
        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
        rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1000.0,
                                            "factor": 2.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}})),
}


def prompts():
  """3 prompts of 3, 11 and 20 random ids (seeded)."""
  rng = np.random.default_rng(SEED)
  return [[int(t) for t in rng.integers(3, _SHAPE["vocab_size"], n)] for n in (3, 11, 20)]


def build(family: str, directory: str, seed: int = SEED):
  """A random fp32 `family` model saved by transformers into `directory`; returns the model."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  cls_name, extra = FAMILIES[family]
  config = getattr(transformers, cls_name)(**_SHAPE, **extra)
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                       dtype=torch.float32)
  gemma = family.startswith("gemma")
  with torch.no_grad():
    for name, p in model.named_parameters():   # tied weights appear once
      if "embed" in name:   # Gemma multiplies by sqrt(hidden): keep the residual O(1)
        p.copy_(torch.randn_like(p) * (0.25 if gemma else 0.5))
      elif p.ndim == 2:     # [out, in] Linear
        p.copy_(torch.randn_like(p) * 1.5 / p.shape[1] ** 0.5)
      elif name.endswith("norm.weight"):
        p.copy_((0.0 if gemma else 1.0) + 0.3 * torch.randn_like(p))
      else:                 # biases
        p.copy_(0.5 * torch.randn_like(p))
  model.eval()
  if os.path.exists(directory):
    shutil.rmtree(directory)
  model.save_pretrained(directory, safe_serialization=True)
  gen = os.path.join(directory, "generation_config.json")
  if os.path.exists(gen):
    os.remove(gen)
  return model


def greedy(model, prompt, max_tokens: int = MAX_TOKENS):
  """(tokens, f32[max_tokens, vocab] logits of each step) by full recomputation."""
  import torch  # pylint: disable=g-import-not-at-top
  ids, out, steps = list(prompt), [], []
  with torch.no_grad():
    for _ in range(max_tokens):
      logits = model(torch.tensor([ids])).logits[0, -1].float().numpy()
      nxt = int(np.argmax(logits))
      out.append(nxt)
      steps.append(logits)
      ids.append(nxt)
  return out, np.stack(steps)


def top2_margin(step_logits: np.ndarray) -> float:
  """Smallest gap between the best and second-best logit over the steps."""
  top = np.sort(step_logits, axis=-1)
  return float((top[:, -1] - top[:, -2]).min())


def golden(model, family: str) -> dict:
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  outs, last, sums, margins = [], [], [], []
  for p in prompts():
    tokens, steps = greedy(model, p)
    outs.append(tokens)
    last.append([float(f"{x:.7g}") for x in steps[-1]])
    sums.append(float(np.abs(steps).astype(np.float64).sum()))
    margins.append(top2_margin(steps))
  return {"family": family, "prompts": prompts(), "max_tokens": MAX_TOKENS, "outputs": outs,
          "last_logits": last, "logits_abs_sum": sums, "min_top2_margin": min(margins),
          "transformers_version": transformers.__version__, "torch_version": torch.__version__}


def main(families=tuple(FAMILIES)):
  for family in families:
    directory = os.path.join(OUT, family)
    model = build(family, directory)
    doc = golden(model, family)
    with open(os.path.join(directory, "golden.json"), "w") as f:   # one line per key
      f.write("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in doc.items())
              + "\n}\n")
    size = sum(os.path.getsize(os.path.join(directory, fn)) for fn in os.listdir(directory))
    print(f"{family}: {size / 1024:.0f} KB, min top-2 margin {doc['min_top2_margin']:.4f}, "
          f"distinct tokens per output {[len(set(o)) for o in doc['outputs']]}")


if __name__ == "__main__":
  main(tuple(sys.argv[1:]) or tuple(FAMILIES))
