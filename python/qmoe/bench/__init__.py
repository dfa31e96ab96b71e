"""GPU benchmarks (`qmoe bench ...`). Each submodule has a `main(argv) -> int` entry point:

    gemm   the W4A8 grouped GEMM (qmoe.compat.sgl_kernel.cutlass_w4a8_moe_mm) at model shapes,
           against the measured floor and torch's grouped GEMMs in the same run (DESIGN.md 8).
"""
