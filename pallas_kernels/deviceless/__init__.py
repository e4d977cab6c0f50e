"""Compile for an H100 / H200 that is not there: XLA's GPU pipeline run on a CPU host
(see the gpu-compile-offline notes). Used by tests and experiments/gpu_compile_report;
no kernel imports it.

  target.py           the compile-only H200, `compile_report` (launches, registers, spills,
                      temp buffers), lowering helpers
  cases.py            the model shapes and workloads both reports compile, and their args
  triton_configs.py   the Triton kernels' configurations and their report rows
  mosaic_configs.py   the Mosaic GPU kernels' configurations and their report rows
"""
