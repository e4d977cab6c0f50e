"""The allocator's state: `BlockState`, an immutable pytree with shapes fixed by one
`CacheConfig`, its constructor and the static checks every block op runs on it.

The ops that change it (allocate, append, free, fork, token_slots) are in
`paged_jax.block_manager`, which re-exports these names.
"""

from __future__ import annotations

import chex
import flax
import jax
import jax.numpy as jnp

from paged_jax.config import CacheConfig

_I32 = jnp.int32


@flax.struct.dataclass
class BlockState:
  """Allocator state; all shapes fixed by the `CacheConfig`.

  Attributes:
    ref_count: i32[num_blocks], table entries pointing at each block.
    free_stack: i32[num_blocks]; `free_stack[:num_free]` are the free block ids,
      popped from the top (index `num_free - 1`).
    num_free: i32[], free blocks.
    block_tables: i32[max_seqs, max_blocks_per_seq], physical block of each
      logical block; -1 where the slot holds no block.
    seq_lens: i32[max_seqs], tokens held by each slot.
    active: bool[max_seqs], slot holds a sequence.
    block_size: tokens per block (static).
  """
  ref_count: jax.Array
  free_stack: jax.Array
  num_free: jax.Array
  block_tables: jax.Array
  seq_lens: jax.Array
  active: jax.Array
  block_size: int = flax.struct.field(pytree_node=False)

  @property
  def num_blocks(self) -> int:
    return self.ref_count.shape[0]

  @property
  def max_seqs(self) -> int:
    return self.block_tables.shape[0]

  @property
  def max_blocks_per_seq(self) -> int:
    return self.block_tables.shape[1]

  @property
  def max_seq_len(self) -> int:
    return self.max_blocks_per_seq * self.block_size


def init(cache_config: CacheConfig) -> BlockState:
  """An empty allocator: every block free, no slot active. Pops blocks 0, 1, ..."""
  nb, s, p = cache_config.num_blocks, cache_config.max_seqs, cache_config.max_blocks_per_seq
  return BlockState(
      ref_count=jnp.zeros((nb,), _I32),
      free_stack=jnp.arange(nb - 1, -1, -1, dtype=_I32),
      num_free=jnp.asarray(nb, _I32),
      block_tables=jnp.full((s, p), -1, _I32),
      seq_lens=jnp.zeros((s,), _I32),
      active=jnp.zeros((s,), jnp.bool_),
      block_size=cache_config.block_size)


def check_state(state: BlockState) -> None:
  """chex: the state's arrays have the shapes and dtypes of one CacheConfig. Shapes and
  dtypes are static, so inside jit this runs once at trace time and costs nothing."""
  nb, s = state.ref_count.shape[0], state.block_tables.shape[0]
  chex.assert_rank(state.block_tables, 2, custom_message="BlockState.block_tables")
  chex.assert_shape([state.ref_count, state.free_stack], (nb,),
                    custom_message="BlockState.ref_count, free_stack")
  chex.assert_shape(state.num_free, (), custom_message="BlockState.num_free")
  chex.assert_shape([state.seq_lens, state.active], (s,),
                    custom_message="BlockState.seq_lens, active")
  chex.assert_type([state.ref_count, state.free_stack, state.num_free, state.block_tables,
                    state.seq_lens, state.active], [_I32] * 5 + [jnp.bool_],
                   custom_message="BlockState")


def int_arg(x, name: str, max_rank: int = 1) -> jax.Array:
  """`x` as an int32 array of rank <= max_rank; a float or bool argument is an error (chex,
  naming `name`), not silently truncated. Static checks: free inside jit."""
  x = jnp.asarray(x)
  chex.assert_rank(x, set(range(max_rank + 1)), custom_message=name)
  chex.assert_type(x, int, custom_message=name)
  return x.astype(_I32)
