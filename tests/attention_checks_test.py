"""Bad shapes and dtypes fail the same way on every attention backend, before anything is
traced or dispatched (pallas_kernels/checks.py): a one-line ValueError naming the
argument, its shape and the expected one.

Each case runs through `paged_jax.attention` with every CPU-runnable spelling, and
through each table entry's op directly (the reference, the xla path, the XLA:CPU custom
calls, the Triton and Mosaic GPU kernel wrappers), so no path reaches XLA with a bad
shape. Before these checks, q's head_dim unlike the pages', q heads not a multiple of the
KV heads, or a block table whose batch differs from q's reached the CPU custom call and
failed inside jax/_src/dispatch.py, the first with the wrong reason.
"""

import os
import traceback

import jax
import jax.numpy as jnp
import pytest

from paged_jax import attention
from pallas_kernels import backends

SPELLINGS = ["auto", "reference", "xla", "cpu", "pallas_interpret", "pallas_interpret:triton",
             "pallas_interpret:mosaic_gpu"]
# Every table entry that can run on a CPU (the TPU kernels are not in this tree yet).
KEYS = [k for k in backends.TABLE if k.family != "tpu" and (k.interpret or
                                                           k.implementation != "pallas")]
CHECKS_FILE = os.path.join("pallas_kernels", "checks.py")


def _decode(b=2, hq=4, hkv=2, d=64, nb=8, bs=16, p=4, dtype=jnp.float32):
  return dict(q=jnp.zeros((b, hq, d), dtype), k_pages=jnp.zeros((hkv, nb, bs, d), dtype),
              v_pages=jnp.zeros((hkv, nb, bs, d), dtype),
              block_tables=jnp.zeros((b, p), jnp.int32), lengths=jnp.ones((b,), jnp.int32))


def _ragged(t=6, s=3, hq=4, hkv=2, d=64, nb=8, bs=16, p=4):
  return dict(q=jnp.zeros((t, hq, d)), k_pages=jnp.zeros((hkv, nb, bs, d)),
              v_pages=jnp.zeros((hkv, nb, bs, d)), block_tables=jnp.zeros((s, p), jnp.int32),
              kv_lens=jnp.ones((s,), jnp.int32), cu_q_lens=jnp.arange(s + 1, dtype=jnp.int32),
              num_seqs=s)


# (name, arguments, argument named, text of the shape it has, text of what is expected)
DECODE_CASES = [
    ("head_dim", dict(_decode(), q=jnp.zeros((2, 4, 32))), "k_pages", "(2, 8, 16, 64)",
     "head_dim=32"),
    ("heads", dict(_decode(), q=jnp.zeros((2, 3, 64))), "k_pages", "(2, 8, 16, 64)",
     "dividing num_q_heads=3"),
    ("table_batch", dict(_decode(), block_tables=jnp.zeros((3, 4), jnp.int32)),
     "block_tables", "(3, 4)", "[batch=2, pages_per_seq]"),
    ("lengths", dict(_decode(), lengths=jnp.ones((3,), jnp.int32)), "lengths", "(3,)",
     "[batch=2]"),
    ("q_rank", dict(_decode(), q=jnp.zeros((2, 64))), "q", "(2, 64)",
     "[batch, num_q_heads, head_dim]"),
    ("v_pages", dict(_decode(), v_pages=jnp.zeros((2, 8, 8, 64))), "v_pages",
     "(2, 8, 8, 64)", "block_size=16"),
    ("table_dtype", dict(_decode(), block_tables=jnp.zeros((2, 4))), "block_tables",
     "float32", "integer"),
    ("scales", dict(_decode(), k_scales=jnp.ones((2, 8, 8)), v_scales=jnp.ones((2, 8, 8))),
     "k_scales", "(2, 8, 8)", "block_size=16"),
]
RAGGED_CASES = [
    ("head_dim", dict(_ragged(), q=jnp.zeros((6, 4, 32))), "k_pages", "(2, 8, 16, 64)",
     "head_dim=32"),
    ("heads", dict(_ragged(), q=jnp.zeros((6, 3, 64))), "k_pages", "(2, 8, 16, 64)",
     "dividing num_q_heads=3"),
    ("kv_lens", dict(_ragged(), kv_lens=jnp.ones((2,), jnp.int32)), "kv_lens", "(2,)",
     "[num_seqs=3]"),
    ("cu_q_lens", dict(_ragged(), cu_q_lens=jnp.zeros((3,), jnp.int32)), "cu_q_lens",
     "(3,)", "[num_seqs+1=4]"),
    ("num_seqs", dict(_ragged(), num_seqs=jnp.zeros((2,), jnp.int32)), "num_seqs", "(2,)",
     "shape ()"),
]


def _check_error(excinfo, name, has, want):
  msg = str(excinfo.value)
  assert "\n" not in msg, msg
  assert msg.startswith(name) and has in msg and want in msg, msg
  # Raised by the checks, not by XLA or a kernel half-way through.
  assert traceback.extract_tb(excinfo.tb)[-1].filename.endswith(CHECKS_FILE)


ENTRIES = {"decode": attention.paged_attention, "ragged": attention.ragged_paged_attention}


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("op,case", [("decode", c) for c in DECODE_CASES]
                         + [("ragged", c) for c in RAGGED_CASES],
                         ids=lambda x: x if isinstance(x, str) else x[0])
def test_bad_shapes_through_the_attention_entry(op, case, spelling):
  _, args, name, has, want = case
  with pytest.raises(ValueError) as e:
    ENTRIES[op](**args, backend=spelling)
  _check_error(e, name, has, want)


@pytest.mark.parametrize("key", KEYS, ids=lambda k: k.spelling)
def test_every_backend_op_checks_itself(key):
  """Each op the table names, called directly (as tests and benchmarks do), refuses every
  bad case on its own, inside jit too (at trace time, before any dispatch)."""
  kernels = backends.TABLE[key]
  kw = {"interpret": True} if key.implementation == "pallas" else {}
  for op, cases in (("decode", DECODE_CASES), ("ragged", RAGGED_CASES)):
    fn = kernels.op(op)
    for _, args, name, has, want in cases:
      with pytest.raises(ValueError) as e:
        fn(**args, **kw)
      _check_error(e, name, has, want)
      arrays = {k: v for k, v in args.items() if k != "num_seqs" or hasattr(v, "shape")}
      rest = {k: v for k, v in args.items() if k not in arrays}
      with pytest.raises(ValueError) as e:
        jax.jit(lambda a: fn(**a, **rest, **kw))(arrays)
      _check_error(e, name, has, want)


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_semantic_arguments_are_checked_everywhere(spelling):
  for kw, needle in ((dict(soft_cap=0.0), "soft_cap"), (dict(sm_scale=float("nan")),
                                                        "sm_scale"),
                     (dict(sliding_window=0), "sliding_window")):
    with pytest.raises(ValueError, match=needle) as e:
      attention.paged_attention(**_decode(), backend=spelling, **kw)
    assert "\n" not in str(e.value)


def test_a_misspelled_argument_is_a_type_error_everywhere():
  for spelling in SPELLINGS:
    with pytest.raises(TypeError, match="softcap"):
      attention.paged_attention(**_decode(), backend=spelling, softcap=2.0)
