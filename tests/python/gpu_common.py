"""Shared by the GPU test modules: the skip rules (torch, a CUDA device, sm_90, a kernels build)
and numpy <-> torch conversions for qmoe's dtypes (bf16 and e4m3 travel as same-size integers)."""
import contextlib
import os

import ml_dtypes
import numpy as np
import pytest


def require_hopper():
    """Skip the calling module unless it can run qmoe's sm_90a kernels; returns torch."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():  # pragma: no cover - CPU-only machines
        pytest.skip("no CUDA device", allow_module_level=True)
    if torch.cuda.get_device_capability() != (9, 0):  # pragma: no cover
        pytest.skip("qmoe's kernels are built for sm_90a (Hopper) only", allow_module_level=True)
    from qmoe import _C

    if not _C.kernels_built():  # pragma: no cover
        pytest.skip("the qmoe extension under test was built without the sm_90a kernels", allow_module_level=True)
    return torch


def to_np(t) -> np.ndarray:
    """A torch tensor as numpy (bf16 / e4m3 as the ml_dtypes types)."""
    import torch

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return t.numpy()


def to_dev(a, device="cuda"):
    """A numpy array as a torch tensor on `device` (anything else passes through)."""
    from qmoe import testing

    return testing.to_torch(a, device)


# ---- shared by the fused-MoE GPU test modules ----------------------------------------------------
GPT_OSS = dict(swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=7.0)  # gpt-oss's swiglu_oai
ACTIVATION_CASES = [
    ("swiglu", {}),
    ("swiglu", GPT_OSS),
    ("geglu_tanh", {}),
    ("relu2", {}),
    ("situ", dict(situ_beta=2.0, situ_linear_beta=3.0)),
]
ACTIVATION_IDS = ["swiglu", "swiglu_gpt_oss", "geglu_tanh", "relu2", "situ"]


def local_slots(case) -> np.ndarray:
    """[T, k] bool: slot whose id is a valid local expert (make_fused_moe_case's routing rule)."""
    ids = case["topk_ids"].astype(np.int64)
    e_l = case["num_local_experts"] if case["num_local_experts"] is not None else case["num_experts"]
    lo = case["local_expert_offset"]
    return (ids >= 0) & (ids < case["num_experts"]) & (ids >= lo) & (ids < lo + e_l)


def on_device(case: dict) -> dict:
    """A make_fused_moe_case with every array on the GPU."""
    from qmoe import testing

    return testing.to_torch(case, "cuda")


def run_gpu(case_dev: dict, output_dtype="bfloat16", **options):
    """qmoe.fused_moe on CUDA tensors into a NaN-poisoned output (returned, synchronized)."""
    import torch

    import qmoe

    tokens, hidden = case_dev["topk_ids"].shape[0], case_dev["w2"].shape[1]
    out = torch.full((tokens, hidden), float("nan"), dtype=getattr(torch, output_dtype), device="cuda")
    got = qmoe.fused_moe(**case_dev, out=out, **options)
    assert got is out
    torch.cuda.synchronize()
    return out


def run_cpu(case: dict, output_dtype="bfloat16", **options) -> np.ndarray:
    """The C++ CPU engine on the numpy case."""
    import qmoe

    return qmoe.fused_moe(**case, output_dtype=output_dtype, **options)



def replay_with_new_routings(base, dev, out, body, routings):
    """CUDA-graph capture and replay with new routings, as an engine does: body() (which writes `out` from the
    device case `dev` of the numpy case `base`) is captured by testing.capture_graph after one warm-up run on a
    side stream (lazy loading, function attributes), then for each (seed, testing.make_routing keywords) of `routings` the new
    topk_ids / topk_weights are copied into dev's tensors, `out` is NaN-poisoned and the graph replayed. Yields
    (seed, the numpy case with that routing, the output as numpy) for the caller to compare."""
    import torch

    from qmoe import testing

    graph = testing.capture_graph(body, warmup=1)
    tokens, top_k = base["topk_ids"].shape
    for seed, kw in routings:
        ids, weights = testing.make_routing(tokens, top_k, base["num_experts"], seed, **kw)
        dev["topk_ids"].copy_(torch.from_numpy(ids))
        dev["topk_weights"].copy_(torch.from_numpy(weights))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        yield seed, dict(base, topk_ids=ids, topk_weights=weights), to_np(out)


# ---- helpers of the fused-epilogue tests (test_gpu_fused_epilogue.py, test_gpu_fused_epilogue_fp4.py) ----------
FUSED_EPILOGUE_ENV = "QMOE_FUSED_EPILOGUE"


@contextlib.contextmanager
def env_var(name, value):
    """The environment variable `name` set to `value` (None: unset) for the calls inside (the pipelines read
    their switches on every call), restored afterwards."""
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def fused_epilogue(enabled):
    """QMOE_FUSED_EPILOGUE for the calls inside: True "1" (fused wherever supported), False "0" (never), None
    unset (the pipeline's rule)."""
    return env_var(FUSED_EPILOGUE_ENV, None if enabled is None else ("1" if enabled else "0"))


def fused_moe_dims(case):
    """(slots, local experts, H, I, GEMM1 rows) of a make_fused_moe_case."""
    tokens, top_k = case["topk_ids"].shape
    hidden, inter = case["w2"].shape[1], 2 * case["w2"].shape[2]
    local = case["num_local_experts"] if case["num_local_experts"] is not None else case["num_experts"]
    rows1 = inter if case["activation"] == "relu2" else 2 * inter
    return tokens * top_k, local, hidden, inter, rows1


def workspace_offsets(slots, local, hidden, inter, rows1, bf16_operands):
    """Byte offsets of the fused pipeline's workspace (src/cuda/fused/fused_moe_workspace.h):
    fused_moe_workspace_layout (w4a8_int4: e4m3 A1 / A2, y, scalars) or, bf16_operands,
    fused_moe_bf16_w4_workspace_layout (bf16 A1 / A2, y over a1)."""
    at, off = 0, {}

    def take(name, nbytes):
        nonlocal at
        off[name] = at
        at += (nbytes + 255) // 256 * 256

    take("local_ids", 4 * slots)
    take("expert_offsets", 4 * (local + 1))
    take("problem_sizes1", 12 * local)
    take("problem_sizes2", 12 * local)
    take("input_permutation", 4 * slots)
    take("output_permutation", 4 * slots)
    elem = 2 if bf16_operands else 1
    take("a1", elem * slots * hidden)
    take("s1", 4 * slots)
    take("h", 4 * slots * rows1)
    take("a2", elem * slots * inter)
    take("s2", 4 * slots)
    if not bf16_operands:
        take("y", 2 * slots * hidden)
        take("scalars", 16)
    off["total"] = at
    return off


def expected_offsets(case):
    """expert_offsets [E_l + 1] of the pipeline's routing (counts of local slots per local expert)."""
    _, local, *_ = fused_moe_dims(case)
    keep = local_slots(case)
    ids = case["topk_ids"].astype(np.int64)[keep] - case["local_expert_offset"]
    counts = np.bincount(ids, minlength=local)
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)


EPILOGUE_POISON = 0xAA  # the byte the fused-epilogue tests fill the workspace with
# Ragged routings of the fused-epilogue tests: name -> (tokens, top_k, experts, make_fused_moe_case keywords).
EPILOGUE_SHAPES = {
    "T1": (1, 1, 8, {}),
    "T1_k8": (1, 8, 64, {}),
    "T7_empty_expert": (7, 4, 16, dict(empty_expert=3, minus_one=2, out_of_range=2)),
    "T37_one_expert": (37, 1, 16, dict(expert_range=(5, 6))),
    "T129_hot_expert": (129, 4, 16, dict(hot_expert=2)),
    "T33_ep": (33, 2, 16, dict(num_local_experts=6, local_expert_offset=5, expert_range=(3, 13))),
}


def run_fused_moe_in_workspace(case, dev, fused, deterministic, bf16_operands, **options):
    """One qmoe.fused_moe call on the device case `dev` (of the numpy `case`) with QMOE_FUSED_EPILOGUE as
    `fused` (fused_epilogue), into a caller-owned workspace filled with EPILOGUE_POISON and a NaN-poisoned
    bf16 output. Returns the output and, read back from the workspace (workspace_offsets), the routing
    offsets, h, A2 ([rows, I]: int16 bf16 bits, or uint8 e4m3 codes) and s2 of the valid rows, and the raw
    bytes of the other routing buffers and of A1 / s1 (valid rows)."""
    import torch

    import qmoe

    slots, local, hidden, inter, rows1 = fused_moe_dims(case)
    lay = workspace_offsets(slots, local, hidden, inter, rows1, bf16_operands)
    ws = torch.full((lay["total"],), EPILOGUE_POISON, dtype=torch.uint8, device="cuda")
    out = torch.full((case["topk_ids"].shape[0], hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    with fused_epilogue(fused):
        got = qmoe.fused_moe(**dev, out=out, workspace=ws, deterministic=deterministic, **options)
    torch.cuda.synchronize()
    assert got is out

    def region(name, nbytes):
        return ws[lay[name]:lay[name] + nbytes]

    offsets = region("expert_offsets", 4 * (local + 1)).view(torch.int32).clone()
    rows = int(offsets[-1])
    a2 = region("a2", (2 if bf16_operands else 1) * rows * inter).clone()
    elem = 2 if bf16_operands else 1
    return dict(out=out, offsets=offsets, rows=rows,
                h=region("h", 4 * rows * rows1).clone(),
                a2=(a2.view(torch.int16) if bf16_operands else a2).view(rows, inter),
                s2=region("s2", 4 * rows).view(torch.float32).clone(),
                # the routing buffers and GEMM1's operand (raw bytes of the valid rows)
                sizes1=region("problem_sizes1", 12 * local).clone(), sizes2=region("problem_sizes2", 12 * local).clone(),
                input_permutation=region("input_permutation", 4 * slots).clone(),
                output_permutation=region("output_permutation", 4 * slots).clone(),
                a1=region("a1", elem * rows * hidden).clone(), s1=region("s1", 4 * rows).clone())


def bits(t):
    """The bits of an fp32 / 16-bit tensor, for bitwise comparisons."""
    import torch

    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def assert_same_intermediate(fused, sep, what, want_offsets, expect_fused, deterministic):
    """The checks both fused-epilogue test modules make on one pair of run_fused_moe_in_workspace results
    (fused path allowed / kept apart): the routing offsets as expected, which path ran (the separate path
    writes h, the fused one never does; expect_fused None: not checked), A2 and s2 bit for bit equal, and
    the deterministic outputs bit for bit equal."""
    import torch

    for r in (fused, sep):
        assert np.array_equal(r["offsets"].cpu().numpy(), want_offsets), f"{what}: workspace layout"
    if fused["rows"] > 0:
        assert not bool((sep["h"] == EPILOGUE_POISON).all()), f"{what}: separate path left h unwritten"
        if expect_fused is not None:
            assert bool((fused["h"] == EPILOGUE_POISON).all()) == expect_fused, \
                f"{what}: fused epilogue {'not ' if expect_fused else ''}taken"
    assert torch.equal(fused["a2"], sep["a2"]), \
        f"{what}: A2 differs in {int((fused['a2'] != sep['a2']).sum())} of {fused['a2'].numel()} values"
    assert torch.equal(bits(fused["s2"]), bits(sep["s2"])), f"{what}: s2 differs"
    if deterministic:
        assert torch.equal(bits(fused["out"]), bits(sep["out"])), f"{what}: deterministic outputs differ"


def fresh_tuner(tune):
    """A new, empty Tuner for one test. Under compute-sanitizer (QMOE_SANITIZER, set by
    scripts/gpu_tests.sh) each candidate is timed by a single run instead of 2 warm-ups + 5 timed
    runs: the tests check what is cached and replayed, not which tactic wins, and every run of an
    instrumented kernel costs seconds."""
    import functools
    import os

    if os.environ.get("QMOE_SANITIZER"):
        return tune.Tuner(timer=functools.partial(tune.cuda_event_timer, warmup=0, repeats=1))
    return tune.Tuner()
