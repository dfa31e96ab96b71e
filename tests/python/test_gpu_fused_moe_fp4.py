"""GPU tests of qmoe.fused_moe for the bf16 x 4-bit pipeline: quant_modes w4a16 (bf16 x NVFP4),
w4a16_int4 (bf16 x int4-g128), w4a4 (NVFP4 x NVFP4, optional per-token scale) and w4a8
(MXFP8 x MXFP4) (src/cuda/fused/sm90_fused_moe_bf16_w4.cu; DESIGN.md 1, 3, 3b, 4, 5.2).

Every case runs the same data twice: as torch CUDA tensors (local ids, routing, gather + exact
dequantization to bf16, GEMM1 with fp32 output, activation + bf16 / NVFP4 / MXFP8 intermediate,
GEMM2, finalize) and as numpy arrays (the C++ CPU engine, src/reference/fused_moe.cpp), and compares
them with qmoe.testing's tolerance for the mode (rel. RMS <= 1e-2, 2e-2 for w4a4; NaN where the
reference is finite fails). The GPU output is poisoned with NaN before each run, so an unwritten
element fails.

Coverage: each mode x every activation (swiglu plain and gpt-oss alpha/beta/limit, geglu_tanh,
relu2, situ with linear beta) x both gate/up layouts x both finalizes x EP on/off; T in
{1, 7, 128, 515} x top-k {1, 2, 8} x E {8, 128} (output dtypes rotated); model shapes at T = 4
(gpt-oss-120b, H = I = 2880, for the FP4 modes; Qwen3-30B-A3B for int4), as one EP rank so the
numpy weights stay small; tokens with no local expert (exact zero rows); no local slot at all; all
tokens on one expert; a zero GEMM1 (w1_alpha = 0: a zero intermediate row, the per-token
row_scale == 0 branch); w4a4 per_token_scale; NaN propagation; every bf16 GEMM tactic forced and a
W4A8-only tactic refused; deterministic mode bitwise equal over 5 runs and on a second stream;
CUDA-graph capture replayed with new routing; the workspace and GPU-limit errors.
At the end of the module the worst relative RMS (and max_rel) per mode is printed.
"""
from __future__ import annotations

import sys
from collections import defaultdict

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from gpu_common import (  # noqa: E402
    ACTIVATION_CASES, ACTIVATION_IDS, on_device, run_cpu, run_gpu, GPT_OSS, local_slots, replay_with_new_routings,
    require_hopper, to_np)

torch = require_hopper()

import qmoe  # noqa: E402
from qmoe import _C  # noqa: E402
from qmoe import quant  # noqa: E402
from qmoe import testing  # noqa: E402

DEV = torch.device("cuda")
MODES = ("w4a16", "w4a16_int4", "w4a4", "w4a8")
FP4_MODES = ("w4a16", "w4a4", "w4a8")
# The bf16 x 4-bit GEMM's compiled tactics (NOTE: src/tune/tactics.cpp compiled_bf16(), one for one).
BF16_TACTICS = ("decode_m128_n8_k256", "decode_m128_n16_k256", "prefill_m128_n64_k128", "decode_m128_n32_k256",
                "decode_m128_n24_k256", "prefill_m128_n128_k128", "prefill_m128_n160_k128",
                "decode_m64_n8_k256")
W4A8_ONLY_TACTIC = "decode_m64_n32_k512"  # compiled for the int4 x e4m3 GEMM only

_ERRORS = defaultdict(list)  # mode -> [(rel_rms, max_rel, what)]


@pytest.fixture(scope="module", autouse=True)
def _report_errors(request):
    """Prints the worst relative RMS per mode once the module has run (past pytest's capture)."""
    yield
    lines = ["", "bf16 x 4-bit fused MoE vs the CPU engine (worst over the checks that ran):"]
    for mode in sorted(_ERRORS):
        e, m, what = max(_ERRORS[mode])
        lines.append(f"  {mode:16s} rel_rms {e:.3e} (tol {testing.TOLERANCES[mode]:.0e})  max_rel {m:.3e}  "
                     f"[{what}; {len(_ERRORS[mode])} checks]")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        print("\n".join(lines), file=sys.stderr)
        return
    with capture.global_and_fixture_disabled():
        for line in lines:
            reporter.write_line(line)


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def tolerance_key(case: dict) -> str:
    per_token = case.get("per_token_scale") is not None
    return "w4a4_per_token" if per_token else case["quant_mode"]


def compare(gpu, cpu, case: dict, what: str):
    key = tolerance_key(case)
    e, m = testing.assert_close(gpu, cpu, case["quant_mode"], tol=testing.TOLERANCES[key], what=what)
    _ERRORS[key].append((e, m, what))
    return e, m


def check(case: dict, output_dtype="bfloat16", what="output", tactic=None, **options):
    """GPU vs the C++ CPU engine on the same data (tactic: forced on the GPU only; the CPU engine
    has none); returns (gpu, cpu) as numpy arrays."""
    gpu_options = dict(options, tactic=tactic) if tactic is not None else options
    gpu = to_np(run_gpu(on_device(case), output_dtype, **gpu_options))
    cpu = run_cpu(case, output_dtype, **options)
    assert gpu.dtype == cpu.dtype, (gpu.dtype, cpu.dtype)
    compare(gpu, cpu, case, what)
    return gpu, cpu


def make_case(mode, tokens, top_k, experts, hidden=256, inter=128, seed=0, **kw):
    return testing.make_fused_moe_case(mode, tokens, hidden, inter, experts, top_k, seed, **kw)


def widen_w4a4_intermediate(case: dict, amax: float):
    """w4a4 without per-token scales: re-aim the intermediate's encode scale at |act| <= amax
    (make_fused_moe_case aims at 8; ReLU^2 reaches ~20), keeping alpha2 = 1 / (fc2 * gs_w2)."""
    if case["quant_mode"] != "w4a4" or case.get("per_token_scale") is not None:
        return
    old = np.float32(case["fc2_input_scale"][0])
    new = np.float32(448 * 6 / amax)
    case["fc2_input_scale"] = np.array([new], np.float32)
    case["w2_alpha"] = (case["w2_alpha"] * (old / new)).astype(np.float32)



def test_kernels_built():
    assert _C.kernels_built()


# ------------------------------------------------------------------------------------------------
# modes x activations x finalize x EP x gate/up layout
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["gate_up", "up_gate_interleaved64"])
@pytest.mark.parametrize("ep", [False, True], ids=["no_ep", "ep"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "fused"])
@pytest.mark.parametrize("activation,params", ACTIVATION_CASES, ids=ACTIVATION_IDS)
@pytest.mark.parametrize("mode", MODES)
def test_activation_finalize_ep_layout(mode, activation, params, deterministic, ep, layout):
    if activation == "relu2" and layout != "gate_up":
        pytest.skip("relu2 has no gate/up halves")
    experts = 16
    ep_kw = dict(num_local_experts=6, local_expert_offset=5) if ep else {}
    case = make_case(mode, 37, 4, experts, seed=len(activation) + 3 * ep + 7 * MODES.index(mode),
                     activation=activation, gate_up_layout=layout, out_of_range=3, minus_one=2, **ep_kw)
    case.update(params)
    widen_w4a4_intermediate(case, 32.0 if activation == "relu2" else 8.0)
    gpu, cpu = check(case, deterministic=deterministic, routed_scaling_factor=1.5,
                     what=f"{mode} {activation} {layout}")
    # tokens without any local slot are exact zeros on both sides
    none = ~local_slots(case).any(axis=1)
    assert np.all(gpu[none].astype(np.float32) == 0)
    assert np.any(gpu[~none].astype(np.float32) != 0)


# ------------------------------------------------------------------------------------------------
# problem sizes: T, top-k, E (output dtypes rotated)
# ------------------------------------------------------------------------------------------------
SIZE_CASES = [
    # (tokens, top_k, experts): every T in {1, 7, 128, 515, 1024, 4097}, k in {1, 2, 4, 8}, E in {8, 128, 256}
    (1, 1, 8), (1, 8, 128), (7, 2, 128), (7, 8, 8), (128, 1, 128), (128, 8, 8), (515, 2, 8), (515, 8, 128),
    (1024, 4, 256), (4097, 2, 8),
]
OUTPUT_DTYPES = ("bfloat16", "float16", "float32")


@pytest.mark.parametrize("tokens,top_k,experts", SIZE_CASES)
@pytest.mark.parametrize("mode", MODES)
def test_sizes(mode, tokens, top_k, experts):
    i = SIZE_CASES.index((tokens, top_k, experts)) + MODES.index(mode)
    case = make_case(mode, tokens, top_k, experts, seed=tokens + top_k + experts + 11 * MODES.index(mode))
    check(case, output_dtype=OUTPUT_DTYPES[i % 3], deterministic=i % 2 == 0, routed_scaling_factor=2.5,
          what=f"{mode} T={tokens} k={top_k} E={experts}")


@pytest.mark.parametrize("inter", [1024, 768])
@pytest.mark.parametrize("mode", MODES)
def test_prefill_activation_kernels(mode, inter):
    """2400 rows: the bf16 requant loops over rows (rows_batched); I = 1024 takes the row kernel, I = 768 (96
    chunks of 8 features, not a multiple of 128) the flat (row, chunk) kernel, whose NVFP4 / MX blocks are
    reduced over lanes as in the row kernel (moe_activation_requant.cu)."""
    case = make_case(mode, 600, 4, 8, inter=inter, seed=inter + MODES.index(mode), hot_expert=1, empty_expert=6)
    check(case, deterministic=True, what=f"{mode} I={inter}")


@pytest.mark.parametrize("mode", MODES)
def test_hidden_and_inter_not_powers_of_two(mode):
    """int4: H = 512, I = 384 (GEMM1 scales in the [E, K/512, 4N] layout, GEMM2's in [E, K/128, N]);
    FP4: H = 352, I = 224 (11 and 7 blocks of 32: scale columns padded to 4 in the swizzle)."""
    hidden, inter = (512, 384) if mode == "w4a16_int4" else (352, 224)
    case = make_case(mode, 19, 2, 8, hidden=hidden, inter=inter, seed=hidden + inter,
                     gate_up_layout="gate_up")
    check(case, deterministic=True, what=f"{mode} H={hidden} I={inter}")


# ------------------------------------------------------------------------------------------------
# model shapes (T = 4, one EP rank of 8 local experts so the numpy weights stay small)
# ------------------------------------------------------------------------------------------------
MODEL_CASES = [("w4a16", "gpt_oss_120b"), ("w4a4", "gpt_oss_120b"), ("w4a8", "gpt_oss_120b"),
               ("w4a16_int4", "qwen3_30b_a3b")]


@pytest.mark.parametrize("mode,model", MODEL_CASES)
def test_model_shapes(mode, model):
    experts, top_k, hidden, inter = testing.MODEL_SHAPES[model]
    kw = dict(num_local_experts=8, local_expert_offset=60, expert_range=(56, 72))
    params = GPT_OSS if model == "gpt_oss_120b" else {}
    case = testing.make_fused_moe_case(mode, 4, hidden, inter, experts, top_k, seed=22, **kw)
    case.update(params)
    assert local_slots(case).any()
    check(case, deterministic=True, what=f"{mode} {model}")
    check(case, deterministic=False, what=f"{mode} {model}")


# ------------------------------------------------------------------------------------------------
# routing edge cases
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "fused"])
@pytest.mark.parametrize("mode", MODES)
def test_token_without_local_expert_is_zero(mode, deterministic):
    experts, tokens, top_k = 16, 9, 2
    case = make_case(mode, tokens, top_k, experts, seed=14, num_local_experts=4, local_expert_offset=8,
                     expert_range=(8, 12))
    ids = case["topk_ids"].copy()
    ids[2] = [0, 15]     # both non-local
    ids[5] = [-1, 99]    # dropped
    ids[7] = [3, -5]     # non-local and dropped
    case["topk_ids"] = ids
    gpu, cpu = check(case, deterministic=deterministic, what=f"{mode} no local expert")
    for t in (2, 5, 7):
        assert np.all(gpu[t].astype(np.float32) == 0), f"token {t} should be an exact zero row"
        assert np.all(cpu[t].astype(np.float32) == 0)
    assert np.any(gpu[0].astype(np.float32) != 0)


@pytest.mark.parametrize("mode", MODES)
def test_no_local_slot_at_all(mode):
    case = make_case(mode, 5, 2, 16, seed=15, num_local_experts=4, local_expert_offset=0, expert_range=(8, 16))
    gpu = to_np(run_gpu(on_device(case), deterministic=True))
    assert np.all(gpu.astype(np.float32) == 0)


@pytest.mark.parametrize("mode", MODES)
def test_all_tokens_on_one_expert(mode):
    """Every slot on expert 3 (the same expert twice in a token counts twice)."""
    tokens, top_k = 200, 2
    ids = np.full((tokens, top_k), 3, np.int32)
    w = np.random.default_rng(tokens).uniform(0.1, 1.0, (tokens, top_k)).astype(np.float32)
    case = make_case(mode, tokens, top_k, 8, seed=16, routing=(ids, w))
    check(case, deterministic=True, what=f"{mode} one expert")
    check(case, deterministic=False, what=f"{mode} one expert")


@pytest.mark.parametrize("per_token", [False, True], ids=["", "per_token"])
@pytest.mark.parametrize("mode", MODES)
def test_zero_gemm1_gives_zero_rows(mode, per_token):
    """w1_alpha[3] = 0: h = 0, act = 0, md = 0 (NVFP4 sf = 0; per token: row_scale = 0, s2 = 0), so
    expert 3 contributes exactly 0: token 0, whose slots are all on expert 3, is an exact zero row."""
    if per_token and mode != "w4a4":
        pytest.skip("per_token_scale is a w4a4 option")
    case = make_case(mode, 23, 4, 8, seed=31, per_token=per_token, hot_expert=3)
    ids = case["topk_ids"].copy()
    ids[0] = 3
    case["topk_ids"] = ids
    alpha = case.get("w1_alpha")
    alpha = np.ones(8, np.float32) if alpha is None else alpha.copy()
    alpha[3] = 0
    case["w1_alpha"] = alpha
    for deterministic in (True, False):
        gpu, cpu = check(case, deterministic=deterministic, what=f"{mode} zero expert")
        assert np.all(cpu[0].astype(np.float32) == 0)
        assert np.all(gpu[0].astype(np.float32) == 0)


# ------------------------------------------------------------------------------------------------
# w4a4 with per-token activation scales
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ep", [False, True], ids=["no_ep", "ep"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "fused"])
@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
def test_w4a4_per_token_scale(activation, deterministic, ep):
    ep_kw = dict(num_local_experts=6, local_expert_offset=5) if ep else {}
    layout = "gate_up" if activation == "relu2" else "up_gate_interleaved64"
    case = make_case("w4a4", 67, 4, 16, seed=40 + ep, per_token=True, activation=activation,
                     gate_up_layout=layout, out_of_range=2, **ep_kw)
    assert case["per_token_scale"] is not None
    check(case, deterministic=deterministic, what=f"w4a4 per-token {activation}")


def test_w4a4_per_token_scale_matters():
    """Scaling per_token_scale[t] by 4 scales token t's GEMM1 input: the output must change."""
    case = make_case("w4a4", 12, 2, 8, seed=41, per_token=True)
    base, _ = check(case, deterministic=True, what="w4a4 per-token base")
    pts = case["per_token_scale"].copy()
    pts[5] *= 4
    changed, _ = check(dict(case, per_token_scale=pts), deterministic=True, what="w4a4 per-token x4")
    assert not np.array_equal(base[5].astype(np.float32), changed[5].astype(np.float32))
    np.testing.assert_array_equal(base[4].astype(np.float32), changed[4].astype(np.float32))


# ------------------------------------------------------------------------------------------------
# tactics, NaN
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tactic", BF16_TACTICS)
@pytest.mark.parametrize("mode", MODES)
def test_forced_tactic(mode, tactic):
    """Each compiled bf16 x 4-bit GEMM tactic, in both GEMMs (GEMM1 with the fp32 epilogue)."""
    case = make_case(mode, 41, 4, 8, seed=18)
    check(case, deterministic=True, tactic=tactic, what=f"{mode} {tactic}")


def test_w4a8_only_tactic_is_refused():
    case = on_device(make_case("w4a16", 3, 2, 8, seed=19))
    with pytest.raises(Exception, match="tactic"):
        run_gpu(case, tactic=W4A8_ONLY_TACTIC)


@pytest.mark.parametrize("mode", MODES)
def test_nan_propagates(mode):
    """A NaN in token 4's input (a bf16 NaN, or a NaN block scale) gives NaN exactly where the CPU
    engine has it: all of token 4's row, nothing else."""
    case = make_case(mode, 12, 2, 8, seed=20)
    if mode in ("w4a16", "w4a16_int4"):
        x = case["x"].copy()
        x[4, 17] = np.nan
        case["x"] = x
    else:
        sf = case["x_scale"].copy()
        sf.view(np.uint8)[4, 1] = 0x7F if mode == "w4a4" else 0xFF  # e4m3 / ue8m0 NaN codes
        case["x_scale"] = sf
    gpu = to_np(run_gpu(on_device(case), deterministic=True)).astype(np.float32)
    cpu = run_cpu(case, deterministic=True).astype(np.float32)
    assert np.isnan(cpu[4]).all()
    assert np.array_equal(np.isnan(gpu), np.isnan(cpu))
    finite = ~np.isnan(cpu).any(axis=1)
    compare(gpu[finite], cpu[finite], case, f"{mode} NaN elsewhere")


# ------------------------------------------------------------------------------------------------
# determinism, streams, CUDA graphs
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_deterministic_bitwise_over_runs_and_streams(mode):
    case = on_device(make_case(mode, 130, 8, 16, seed=23, out_of_range=5))
    first = run_gpu(case, deterministic=True)
    for _ in range(4):
        again = run_gpu(case, deterministic=True)
        assert torch.equal(first.view(torch.int16), again.view(torch.int16))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = torch.full_like(first, float("nan"))
        qmoe.fused_moe(**case, out=out, deterministic=True)
    side.synchronize()
    assert torch.equal(first.view(torch.int16), out.view(torch.int16))


@pytest.mark.parametrize("mode", MODES)
def test_graph_capture_replays_with_new_routing(mode):
    tokens, top_k, experts = 48, 4, 16
    base = make_case(mode, tokens, top_k, experts, seed=24)
    dev = on_device(base)
    out = torch.empty((tokens, 256), dtype=torch.bfloat16, device=DEV)
    routings = [(1, {}), (2, dict(hot_expert=3)), (3, dict(out_of_range=20, minus_one=10))]
    body = lambda: qmoe.fused_moe(**dev, out=out, deterministic=True)  # noqa: E731
    for seed, case, got in replay_with_new_routings(base, dev, out, body, routings):
        compare(got, run_cpu(case, deterministic=True), case, f"{mode} replay {seed}")


# ------------------------------------------------------------------------------------------------
# workspace and GPU-only limits
# ------------------------------------------------------------------------------------------------
def test_workspace_size_and_errors():
    """Native entry with an explicit workspace: None or one byte short -> 'workspace' error and the
    output untouched; a misaligned one -> 'workspace'; exactly the size -> runs."""
    from qmoe import ops
    from qmoe._tensors import arg, current_stream

    case = on_device(make_case("w4a4", 5, 2, 8, seed=25, per_token=True))
    out = torch.full((5, 256), float("nan"), dtype=torch.bfloat16, device=DEV)
    c = case
    call = ops._layer_call(c["quant_mode"], c["x"], c["x_scale"], c["topk_ids"], c["topk_weights"], c["w1"],
                           c["w1_scale"], c["w1_alpha"], c["fc2_input_scale"], c["w2"], c["w2_scale"],
                           c["w2_alpha"], c["per_token_scale"], (out, "out"), c["num_experts"],
                           c["num_local_experts"], c["local_expert_offset"], c["activation"], 1.0, 0.0,
                           float("inf"), 1.0, None, c["gate_up_layout"], True, 1.0, None)
    need = _C.fused_moe_workspace_size(call)
    # bf16 a1/y [S, H], a2 [S, I], fp32 h [S, 2I]: at least that much
    slots = 5 * 2
    assert need >= 2 * slots * (256 + 128) + 4 * slots * 256
    stream = current_stream(out)
    for ws in (None, torch.empty(need - 1, dtype=torch.uint8, device=DEV)):
        with pytest.raises(Exception, match="workspace"):
            _C.fused_moe(call, arg(ws), stream)
    torch.cuda.synchronize()
    assert torch.isnan(out.float()).all()
    big = torch.empty(need + 256, dtype=torch.uint8, device=DEV)
    with pytest.raises(Exception, match="workspace"):
        _C.fused_moe(call, arg(big[1:need + 1]), stream)
    ws = torch.empty(need, dtype=torch.uint8, device=DEV)
    _C.fused_moe(call, arg(ws), stream)
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()


@pytest.mark.parametrize("hidden,inter", [(144, 128), (128, 80)])
def test_fp4_sizes_not_multiple_of_32_raise(hidden, inter):
    """NVFP4 weights validate with H, I % 16 == 0 (the CPU engine runs them); the GPU needs 32."""
    case = make_case("w4a16", 3, 2, 8, hidden=hidden, inter=inter, seed=26, gate_up_layout="gate_up")
    run_cpu(case, deterministic=True)
    with pytest.raises(Exception, match="w2"):
        run_gpu(on_device(case))


# ------------------------------------------------------------------------------------------------
# packed FP4 weights (quant.pack_fp4_weights, fused_moe(..., fp4_weights_packed=True))
# ------------------------------------------------------------------------------------------------
def packed_weights(case: dict) -> dict:
    """The case with w1 / w2 in qmoe's packed word order (packed on the host)."""
    return dict(case, w1=quant.pack_fp4_weights(case["w1"]), w2=quant.pack_fp4_weights(case["w2"]))


PACKED_SIZE_CASES = [(1, 8, 128), (7, 2, 8), (128, 8, 8), (515, 2, 8), (1024, 4, 256)]


@pytest.mark.parametrize("tokens,top_k,experts", PACKED_SIZE_CASES)
@pytest.mark.parametrize("mode", FP4_MODES)
def test_packed_weights_sizes(mode, tokens, top_k, experts):
    """GPU with packed weights (the heuristic's decode or prefill tiles) vs the CPU engine on the plain ones."""
    i = PACKED_SIZE_CASES.index((tokens, top_k, experts))
    case = make_case(mode, tokens, top_k, experts, seed=90 + tokens + experts + 5 * FP4_MODES.index(mode))
    gpu = to_np(run_gpu(on_device(packed_weights(case)), deterministic=i % 2 == 0, fp4_weights_packed=True))
    compare(gpu, run_cpu(case, deterministic=i % 2 == 0), case, f"{mode} packed T={tokens} k={top_k} E={experts}")


@pytest.mark.parametrize("tactic", BF16_TACTICS)
@pytest.mark.parametrize("mode", FP4_MODES)
def test_packed_weights_every_tactic(mode, tactic):
    case = make_case(mode, 41, 4, 8, seed=91)
    gpu = to_np(run_gpu(on_device(packed_weights(case)), deterministic=True, tactic=tactic, fp4_weights_packed=True))
    compare(gpu, run_cpu(case, deterministic=True), case, f"{mode} packed {tactic}")


@pytest.mark.parametrize("mode", FP4_MODES)
def test_packed_weights_model_shape_ep(mode):
    """gpt-oss-120b (H = I = 2880: 1440-byte rows, 90 NVFP4 / 45 MX blocks) on one EP rank, both finalizes."""
    experts, top_k, hidden, inter = testing.MODEL_SHAPES["gpt_oss_120b"]
    case = testing.make_fused_moe_case(mode, 5, hidden, inter, experts, top_k, seed=92, num_local_experts=8,
                                       local_expert_offset=60, expert_range=(56, 72))
    case.update(GPT_OSS)
    dev = on_device(packed_weights(case))
    for deterministic in (True, False):
        gpu = to_np(run_gpu(dev, deterministic=deterministic, fp4_weights_packed=True))
        compare(gpu, run_cpu(case, deterministic=deterministic), case, f"{mode} packed gpt_oss_120b")


def test_pack_fp4_weights_gpu_matches_cpu():
    rng = np.random.default_rng(93)
    w = rng.integers(0, 256, (3, 40, 64), dtype=np.uint8)
    cpu = quant.pack_fp4_weights(w)
    gpu = quant.pack_fp4_weights(torch.from_numpy(w).cuda())
    assert np.array_equal(gpu.cpu().numpy(), cpu)
    assert not np.array_equal(cpu, w)
    back = quant.unpack_fp4_weights(gpu)
    assert np.array_equal(back.cpu().numpy(), w)


def test_packed_weights_refused_for_int4():
    case = on_device(make_case("w4a16_int4", 3, 2, 8, seed=94))
    with pytest.raises(ValueError, match="fp4_weights_packed"):
        run_gpu(case, fp4_weights_packed=True)
