"""GPU benchmarks (`qmoe bench ...`). Each submodule has a `main(argv) -> int` entry point:

    gemm   the W4A8 grouped GEMM (qmoe.compat.sgl_kernel.cutlass_w4a8_moe_mm) at model shapes,
           against the measured floor and torch's grouped GEMMs in the same run (DESIGN.md 8).
    moe    the whole w4a8_int4 MoE layer (qmoe.fused_moe, both finalizes, eager and CUDA graph)
           against the sum of its GEMM floors, a plain torch._grouped_mm MoE and vLLM's Triton
           fused MoE (peer file); `--dry-run` exercises it without a GPU.

common.py holds what they share: ceilings, floors, CUDA-event / graph timing, routing, weight-set
rotation, numpy <-> torch conversion.
"""
