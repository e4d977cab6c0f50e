"""What the GPU kernels and the deviceless reports assume of an sm_90 GPU (H100 SXM / H200):
its limits, and how many thread blocks of a kernel one SM holds at once."""

from __future__ import annotations

SHARED_MEMORY_BYTES = 232448        # opt-in shared memory per thread block (227 KiB)
SHARED_MEMORY_PER_SM = 233472       # 228 KiB
SHARED_MEMORY_PER_BLOCK_RESERVED = 1024
REGISTERS_PER_SM = 65536
MAX_THREADS_PER_SM = 2048
MAX_BLOCKS_PER_SM = 32
NUM_SMS = 132                       # H100 SXM / H200
HBM_BYTES_PER_S = 4.8e12            # H200


def resident_blocks(registers: int, threads: int, shared_memory: int) -> int:
  """Thread blocks one SM holds at once: registers (allocated per warp in units of 256),
  shared memory (228 KiB per SM, 1 KiB reserved per block), threads, 32 blocks."""
  warps = -(-threads // 32)
  regs_per_warp = -(-registers * 32 // 256) * 256
  by_regs = REGISTERS_PER_SM // max(1, regs_per_warp * warps)
  by_smem = SHARED_MEMORY_PER_SM // (shared_memory + SHARED_MEMORY_PER_BLOCK_RESERVED)
  return max(0, min(by_regs, by_smem, MAX_THREADS_PER_SM // max(1, threads),
                    MAX_BLOCKS_PER_SM))


def wave_efficiency(programs: int, slots: int) -> float:
  """Busy fraction of the SM slots over the waves `programs` take (tail effect)."""
  if programs <= 0 or slots <= 0:
    return 0.0
  waves = -(-programs // slots)
  return programs / (waves * slots)
