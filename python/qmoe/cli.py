"""`qmoe` command line: `qmoe bench [gemm|moe ...]`, `qmoe info`."""
from __future__ import annotations

import argparse
import sys
import time


def _gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _cpu_demo(args) -> int:
    """No GPU: run the CPU reference engine on a small real-model-shaped problem and say so."""
    import numpy as np

    from . import fused_moe, testing

    experts, top_k, hidden, inter = testing.MODEL_SHAPES[args.model]
    print("qmoe bench: no CUDA GPU found -> running the CPU reference engine instead (not a benchmark).")
    print(f"  {args.model}: E={experts} top_k={top_k} H={hidden} I={inter}, T={args.tokens}, "
          "quant_mode=w4a8_int4, deterministic finalize")
    case = testing.make_fused_moe_case("w4a8_int4", args.tokens, hidden, inter, experts, top_k, seed=0)
    start = time.perf_counter()
    out = fused_moe(**case, deterministic=True)
    seconds = time.perf_counter() - start
    out32 = out.astype(np.float32)
    print(f"  CPU reference: {seconds:.2f} s, output [{out.shape[0]}, {out.shape[1]}] bf16, "
          f"rms {float(np.sqrt(np.mean(out32 ** 2))):.4g}, all finite: {bool(np.isfinite(out32).all())}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="qmoe", description="qmoe: quantized MoE kernels for Hopper")
    sub = parser.add_subparsers(dest="command")
    # add_help=False: -h/--help after 'gemm' or 'moe' reaches that benchmark's own parser
    bench = sub.add_parser("bench", add_help=False,
                           help="benchmark on the GPU (CPU reference demo without one); options after 'gemm' "
                                "or 'moe' go to that benchmark (qmoe bench gemm --help, qmoe bench moe --help)")
    bench.add_argument("what", nargs="?", default="gemm", choices=["gemm", "moe"],
                       help="gemm: the W4A8 grouped GEMM; moe: the whole fused MoE layer")
    sub.add_parser("info", help="print build information")
    args, rest = parser.parse_known_args(argv)
    if args.command == "info":
        from . import _C

        print(f"qmoe {_C.__version__}; sm_90a kernels built: {_C.kernels_built()}; GPU: {_gpu_available()}")
        return 0
    if args.command == "bench":
        if args.what == "moe":  # without a GPU it needs --dry-run (it says so)
            from .bench import moe

            return moe.main(rest)
        if _gpu_available():
            from .bench import gemm

            return gemm.main(rest)
        demo = argparse.ArgumentParser(prog="qmoe bench (CPU demo)")
        demo.add_argument("--model", default="qwen3_30b_a3b", help="a qmoe.testing.MODEL_SHAPES key")
        demo.add_argument("--tokens", type=int, default=8)
        return _cpu_demo(demo.parse_args(rest))
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
