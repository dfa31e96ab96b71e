"""Fused w4a8_int4 accuracy per forced GEMM tactic: rel RMS vs the C++ CPU engine (deterministic finalize) over 12
seeds at a few small shapes, mean and max per tactic (mma.sync n16; WGMMA n32 and, since 8db762b, n48 on biased
codes; WGMMA n64 on exact codes).
Device: PYTHONPATH=build/device/pkg python3 bench/fused_accuracy_by_tactic.py (after scripts/device_build.sh; ~15 s).
Results: bench/results/2026-12-03_s36a_*."""
import os
import sys
import numpy as np
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))
from gpu_common import on_device, run_gpu, run_cpu, require_hopper  # noqa
torch = require_hopper()
import qmoe
from qmoe import testing

TACTICS = ["decode_m128_n16_k256", "prefill_m128_n32_k128", "prefill_m128_n48_k128", "prefill_m128_n64_k128"]
CASES = {  # tokens, topk, experts, hidden, inter, kw, per_token
    "T1_k1": (1, 1, 8, 256, 128, {}, False),
    "T13_ep_pt": (13, 4, 16, 256, 128, dict(num_local_experts=6, local_expert_offset=5, expert_range=(3, 13)), True),
    "T40_k4": (40, 4, 8, 512, 256, {}, False),
    "T64_k8_E64_h1024": (64, 8, 64, 1024, 512, {}, False),
}
for name, (t, k, e, h, i, kw, pt) in CASES.items():
    errs = {tac: [] for tac in TACTICS}
    for seed in range(12):
        case = testing.make_fused_moe_case("w4a8_int4", t, h, i, e, k, seed=100 + seed, **kw)
        if pt:
            x = case["x"].astype(np.float32)
            case["x_scale"] = (np.abs(x).max(axis=1) / 448 + 1e-3).astype(np.float32)
        cpu = run_cpu(case, deterministic=True)
        dev = on_device(case)
        for tac in TACTICS:
            out = run_gpu(dev, tactic=tac, deterministic=True)
            errs[tac].append(testing.rel_rms(out.float().cpu().numpy(), cpu.astype(np.float32)))
    print(name, " | ".join(f"{tac.split('_')[2]} mean {np.mean(v):.2e} max {np.max(v):.2e}" for tac, v in errs.items()))
