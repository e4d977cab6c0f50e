"""The engine's compiled steps kept on disk across processes (JAX's persistent cache).

    from paged_jax import compile_cache
    compile_cache.enable()                 # $PAGED_JAX_CACHE/xla or ~/.cache/paged_jax/xla
    compile_cache.enable("/scratch/xla")   # or a directory of your own
    compile_cache.directory()              # where it is on (None: off)

An engine compiles its step once per shape bucket it meets (3-4 s each for the shipped
model on a quiet 2-core CPU, minutes per serving sweep of ~100 shapes). JAX's persistent
compilation cache stores each XLA executable under a key of its HLO, compile options,
jax / jaxlib versions and backend, so a later process meeting the same shapes loads
the executable (~0.6 s a step here) instead of compiling it. Executables that call the
CPU attention custom calls name their FFI targets, which `pallas_kernels.cpu.custom_calls`
registers in every process before a step is traced, so a loaded step runs the same code.

The engine also reloads from here the step shapes whose executables
`paged_jax.executables` released to keep the process under Linux's memory-map limit.

This module only points JAX at a directory beside the CPU kernels' cache and lowers the
smallest compile time worth storing; everything else (keys, eviction, concurrent writers)
is JAX's. The experiments' `--compilation_cache` flag calls `enable`.
"""

from __future__ import annotations

import logging
import os
import pathlib
from typing import Optional, Union

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from pallas_kernels.cpu.custom_calls import cache_root

# A step that compiles faster than this is not worth a file (the block ops' small jits).
DEFAULT_MIN_COMPILE_TIME_S = 0.5
# Past this the least recently used executables are deleted (JAX's LRU eviction, which
# locks the directory with `filelock`): ~200 KB a step of the shipped model, tens of MB
# for a Llama-8B-shaped one.
DEFAULT_MAX_BYTES = 4 << 30


def default_directory() -> pathlib.Path:
  """`xla/` under the project's cache root ($PAGED_JAX_CACHE, else ~/.cache/paged_jax)."""
  return cache_root() / "xla"


def enable(path: Optional[Union[str, os.PathLike]] = None, *,
           min_compile_time_s: float = DEFAULT_MIN_COMPILE_TIME_S,
           max_bytes: int = DEFAULT_MAX_BYTES) -> pathlib.Path:
  """Turns JAX's persistent compilation cache on at `path` (default `default_directory()`),
  created if missing; compiles from then on are stored and looked up there (earlier
  compiles in the process do not matter; a cache already open elsewhere is closed).

  Args:
    path: cache directory.
    min_compile_time_s: store only executables that took at least this long to compile (s).
    max_bytes: the directory's size bound (least recently used entries go first); -1: none.
  Returns:
    The directory.
  Raises:
    ValueError: `path` cannot be created or written, or a bound is out of range.
  """
  if not min_compile_time_s >= 0:
    raise ValueError(f"min_compile_time_s must be >= 0 seconds, got {min_compile_time_s}")
  if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or not (
      max_bytes == -1 or max_bytes >= 1):
    raise ValueError(f"max_bytes must be a positive int of bytes or -1 (no bound), "
                     f"got {max_bytes!r}")
  directory = pathlib.Path(path) if path is not None else default_directory()
  try:
    directory.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise ValueError(f"compilation cache directory {str(directory)!r} cannot be created: "
                     f"{e.strerror or e}") from None
  if not os.access(directory, os.W_OK):
    raise ValueError(f"compilation cache directory {str(directory)!r} is not writable")
  jax.config.update("jax_compilation_cache_dir", str(directory))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  jax.config.update("jax_compilation_cache_max_size", max_bytes)
  _reset()
  return directory


def disable() -> None:
  """Turns the persistent cache off for later compiles in this process."""
  jax.config.update("jax_compilation_cache_dir", None)
  _reset()


def _reset() -> None:
  """JAX opens its cache once, at the first compile that finds a directory set: reset it
  so the next compile opens the directory set now. Quietly: JAX logs each reset at INFO,
  which would add a line to every experiment's output (and to its one-line errors)."""
  logger = logging.getLogger(jax_cache.reset_cache.__module__)
  level = logger.level
  logger.setLevel(logging.WARNING)
  try:
    jax_cache.reset_cache()
  finally:
    logger.setLevel(level)


def directory() -> Optional[str]:
  """The cache directory compiles use now, or None when the cache is off."""
  return jax.config.jax_compilation_cache_dir or None
