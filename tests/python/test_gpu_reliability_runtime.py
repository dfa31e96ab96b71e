"""GPU reliability tests, issue #6 items 4, 5 and 6 (docs/reliability.md, section "GPU"); items 1 and 2
are in test_gpu_reliability.py, the shared helpers in gpu_reliability_common.py.

  test_det_*         item 4: the deterministic finalize bitwise equal over RUNS runs, two side streams,
                     CUDA-graph replay, with other GPU work running (bf16 matmuls and qmoe GEMMs from
                     another thread), and across tactics of one MMA arithmetic (mma.sync, or WGMMA for
                     w4a8_int4; the two differ in fp32 summation order, printed); the fused finalize
                     (deterministic=False) within tolerance every run, its spread measured and printed.
  test_concurrent_*  item 5: two host threads on two streams run every op at once (multi-CTA
                     cooperative routing included, plus a call that always fails) == serial results;
                     then both fill the autotuner's cache at once (a key profiled by one thread while
                     the other waits), the same winners serve a serial replay bit for bit.
  test_fault_*       item 6: refused calls between valid ones (no byte of device memory leaked, valid
                     results unchanged); the workspace allocation refused by torch's allocator; a
                     failed cudaMalloc and a stale error left by another library; CUDA checks failing
                     at every n-th call through the test hook QMOE_TEST_FAIL_LAUNCH (child processes).
Lines starting with "RELIABILITY" are the measurements docs/reliability.md quotes.
"""
from __future__ import annotations

import gc
import json
import os
import random
import subprocess
import sys
import threading
from functools import lru_cache

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

from gpu_common import fresh_tuner as new_tuner, require_hopper, to_np  # noqa: E402

torch = require_hopper()

import qmoe  # noqa: E402
from qmoe import testing, tune  # noqa: E402
from qmoe.compat import sgl_kernel as sgl  # noqa: E402

from gpu_reliability_common import (  # noqa: E402
    DEV, FUSED_MODES, OPS, RUNS, SANITIZER, assert_unchanged, build, fused_case_np,
    fused_kw, gemm_kw, gpu_mode, live_bytes, mm_data_kw, mutate, mutation_labels, on_device, poisoned, raw, report,
    same_bits, snapshot, stable_seed)


# ------------------------------------------------------------------------------------------------
# item 4: determinism
# ------------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def det_case(mode):
    """An odd-sized layer: T = 203, top-8 of 24 experts (20 local), dropped and non-local ids."""
    return fused_case_np(mode, 203, 8, 24, 384, 640, seed=stable_seed("det", mode), num_local_experts=20,
                         local_expert_offset=2, out_of_range=9, minus_one=5)


@lru_cache(maxsize=None)
def det_cpu(mode, deterministic):
    return qmoe.fused_moe(**det_case(mode), deterministic=deterministic)


def run_det(dev, det=True, tactic=None, stream=None):
    out = poisoned((dev["topk_ids"].shape[0], dev["w2"].shape[1]), torch.bfloat16)
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            qmoe.fused_moe(**dev, out=out, deterministic=det, tactic=tactic)
        torch.cuda.current_stream().wait_stream(stream)
    else:
        qmoe.fused_moe(**dev, out=out, deterministic=det, tactic=tactic)
    return out


@pytest.mark.parametrize("mode", FUSED_MODES)
def test_det_runs_streams_graph(mode):
    gpu_mode(mode)
    case = det_case(mode)
    dev = on_device(case)
    first = run_det(dev)
    torch.cuda.synchronize()
    testing.assert_close(to_np(first), det_cpu(mode, True), mode, what="deterministic vs CPU engine")
    for i in range(RUNS - 1):
        assert same_bits(run_det(dev), first), f"run {i + 2} differs"
    for i in range(2):
        assert same_bits(run_det(dev, stream=torch.cuda.Stream()), first), f"side stream {i} differs"
    out = poisoned(tuple(first.shape), torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        qmoe.fused_moe(**dev, out=out, deterministic=True)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qmoe.fused_moe(**dev, out=out, deterministic=True)
    for i in range(min(RUNS, 5)):
        out.fill_(float("nan"))
        graph.replay()
        assert same_bits(out, first), f"graph replay {i} differs"


def background_work(stop):
    """Other GPU work until stop is set: bf16 matmuls on one stream, qmoe GEMMs on another thread's stream."""
    def matmuls():
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            m = torch.randn((4096, 4096), device=DEV, dtype=torch.bfloat16)
            while not stop.is_set():
                m = (m @ m).clamp_(-1, 1)
            s.synchronize()

    def gemms():
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            while not stop.is_set():
                sgl.cutlass_w4a8_moe_mm(**gemm_kw(11, 16, 512, 2048, (40,) * 16)[0])
            s.synchronize()

    # Under racecheck (qmoe's kernels instrumented, torch's not) a cuBLAS matmul running next to an
    # instrumented kernel ends in "Internal Sanitizer Error: failed to handle a hardware exception"
    # (measured 2026-11-30: only with the matmul load; the qmoe load alone and every other tool pass),
    # so there the load is qmoe's GEMMs only. initcheck (every kernel instrumented) reports torch's
    # clamp_ reading the cuBLAS matmul's output as uninitialized, 19 reports a test, none in qmoe
    # (measured 2026-11-30), and the reports' host backtraces slow the test past the device call's
    # limit; there too the load is qmoe's GEMMs. QMOE_TEST_BACKGROUND=matmul|gemm|matmul,gemm overrides.
    default = "gemm" if SANITIZER in ("racecheck", "initcheck") else "matmul,gemm"
    kinds = os.environ.get("QMOE_TEST_BACKGROUND", default).split(",")
    threads = [threading.Thread(target=f) for name, f in (("matmul", matmuls), ("gemm", gemms)) if name in kinds]
    for t in threads:
        t.start()
    return threads


@pytest.mark.parametrize("mode", FUSED_MODES)
def test_det_with_other_work_running(mode):
    gpu_mode(mode)
    dev = on_device(det_case(mode))
    quiet = run_det(dev)
    torch.cuda.synchronize()
    stop = threading.Event()
    threads = background_work(stop)
    try:
        busy = [run_det(dev, stream=s) for s in (None, torch.cuda.Stream()) for _ in range(max(RUNS // 2, 1))]
        torch.cuda.synchronize()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    for i, out in enumerate(busy):
        assert same_bits(out, quiet), f"run {i} under load differs from the quiet run"


@pytest.mark.parametrize("mode", FUSED_MODES)
def test_det_across_tactics(mode, capsys):
    """Per tactic: bitwise equal over 3 runs and within tolerance of the CPU engine. Across tactics of
    one MMA arithmetic (mma.sync, WGMMA or W4A8's biased WGMMA tile, tune.mma_family): bitwise equal. Across them:
    printed."""
    gpu_mode(mode)
    case = det_case(mode)
    dev = on_device(case)
    results = {}
    for tactic in qmoe.valid_tactics(256, 256, 64, 8):
        try:
            first = run_det(dev, tactic=tactic)
            torch.cuda.synchronize()
        except ValueError as e:  # a tactic of the other GEMM kernel
            assert "argument 'tactic'" in str(e)
            continue
        for _ in range(2):
            assert same_bits(run_det(dev, tactic=tactic), first), f"{tactic}: runs differ"
        testing.assert_close(to_np(first), det_cpu(mode, True), mode, what=tactic)
        results[tactic] = first
    if len(results) < 2:
        pytest.skip(f"{mode}: fewer than two tactics")
    groups: dict = {}
    for tactic, out in results.items():
        groups.setdefault(tune.mma_family(tactic, mode), []).append(tactic)
    for cls, members in groups.items():
        for t in members[1:]:
            assert same_bits(results[t], results[members[0]]), f"{cls}: {t} differs from {members[0]}"
    names = sorted(groups)
    for i, fa in enumerate(names):
        for fb in names[i + 1:]:
            a, b = results[groups[fa][0]], results[groups[fb][0]]
            differing = int((raw(a) != raw(b)).sum())
            report(capsys, f"det_across_tactics {mode}: {fa} vs {fb}: {differing} of {a.numel()} elements "
                           f"differ; rel_rms {testing.rel_rms(to_np(a), to_np(b)):.2e}")


@pytest.mark.parametrize("mode", FUSED_MODES)
def test_det_fused_finalize_spread(mode, capsys):
    """use_fused_finalize (deterministic=False): every run within the mode's tolerance of the CPU
    engine; the run-to-run spread (elements that differ, max |diff|) is measured and printed."""
    gpu_mode(mode)
    case = det_case(mode)
    dev = on_device(case)
    # A decode tile for GEMM2: only those scatter with atomics (moe_pipeline_steps.cu); the prefill
    # tiles this shape would pick finalize through the order-fixed kernel.
    outs = [run_det(dev, det=False, tactic="decode_m128_n16_k256") for _ in range(RUNS)]
    torch.cuda.synchronize()
    cpu = det_cpu(mode, False)
    for i, out in enumerate(outs):
        testing.assert_close(to_np(out), cpu, mode, what=f"fused finalize run {i}")
    stack = torch.stack([o.float() for o in outs])
    spread = stack.max(dim=0).values - stack.min(dim=0).values
    scale = float(stack[0].abs().max())
    worst = float(spread.max())
    det = run_det(dev)
    torch.cuda.synchronize()
    line = (f"fused_finalize_spread {mode}: runs={RUNS} bitwise_identical="
            f"{all(same_bits(o, outs[0]) for o in outs)} elements_differing={int((spread != 0).sum())}/"
            f"{spread.numel()} max_abs_diff={worst:.3e} max_rel_diff={worst / scale:.3e} "
            f"rel_rms_vs_deterministic={testing.rel_rms(to_np(outs[0]), to_np(det)):.3e}")
    report(capsys, line)
    # The adds of the top_k bf16 terms into the bf16 output round in arrival order: two orders differ
    # by at most top_k roundings, each half an ULP of a partial sum; partial sums stay below 4x the
    # largest output here, so the bound is top_k ULPs of bf16 at 4 * scale.
    top_k = dev["topk_ids"].shape[1]
    ulp = 2.0 ** (np.floor(np.log2(4 * scale)) - 7)
    assert worst <= top_k * ulp, line


def test_det_gemm_and_mm_data_runs_and_streams():
    kw, _, _ = gemm_kw(21, 6, 200, 640, (3, 70, 0, 1, 33, 129), per_row=True)
    sgl.cutlass_w4a8_moe_mm(**kw)
    first = kw["d"].clone()
    ids = mm_data_kw(22, tokens=4099, top_k=8, experts=300)
    OPS["mm_data"].run(ids)
    meta = [ids[o].clone() for o in OPS["mm_data"].outputs]
    for i in range(RUNS):
        stream = torch.cuda.Stream() if i % 2 else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            kw["d"].fill_(float("nan"))
            sgl.cutlass_w4a8_moe_mm(**kw)
            fresh = mm_data_kw(22, tokens=4099, top_k=8, experts=300)
            OPS["mm_data"].run(fresh)
        stream.synchronize()
        assert same_bits(kw["d"], first), f"GEMM run {i} differs"
        for name, want in zip(OPS["mm_data"].outputs, meta):
            assert torch.equal(fresh[name], want), f"mm_data run {i}: {name} differs"


# ------------------------------------------------------------------------------------------------
# item 5: two host threads, two streams
# ------------------------------------------------------------------------------------------------
class Job:
    """One op call on fixed inputs with fresh poisoned outputs; `exact` compares bit for bit."""

    def __init__(self, name, make, outputs, op, exact=True, mode=None, fails=False):
        self.name, self.make, self.outputs, self.op = name, make, outputs, op
        self.exact, self.mode, self.fails = exact, mode, fails

    def run(self):
        kw = self.make()
        if self.fails:
            snap = snapshot(kw)
            with pytest.raises(ValueError, match="argument 'output'"):
                OPS[self.op].run(kw)
            assert_unchanged(snap, self.name)
            return None
        OPS[self.op].run(kw)
        return [kw[o] for o in self.outputs]

    def same(self, got, want):
        if self.fails:
            return True
        if self.exact:
            return all(same_bits(g, w) for g, w in zip(got, want))
        testing.assert_close(to_np(got[0]), to_np(want[0]), self.mode, what=self.name)
        return True


def available_modes():
    """The fused modes that run on the GPU in this build."""
    modes = []
    for mode in FUSED_MODES:
        try:
            gpu_mode(mode)
            modes.append(mode)
        except pytest.skip.Exception:
            pass
    return modes


def concurrency_jobs(modes):
    """Routing (one CTA, and multi-CTA cooperative launches with E = 256 and 1024), the GEMM (odd
    shapes; decode rows over 64 experts), the fused op per mode (deterministic and fused finalize, two
    token buckets) and a call that is always refused (output aliasing x)."""
    jobs = []
    for tokens, top_k, experts in ((32768, 8, 256), (8192, 8, 1024), (77, 6, 40)):  # multi-CTA routing too
        seed = tokens + experts
        jobs.append(Job(f"mm_data_{tokens}x{top_k}_e{experts}",
                        lambda s=seed, t=tokens, k=top_k, e=experts: mm_data_kw(s, t, k, e),
                        OPS["mm_data"].outputs, "mm_data"))
    gemms = (("gemm_odd", (6, 200, 640, (3, 70, 0, 1, 33, 129))), ("gemm_decode", (64, 512, 1024, (1,) * 64)))
    for name, args in gemms:
        kw0, _, _ = gemm_kw(stable_seed(name), *args)

        def make(kw0=kw0):
            return dict(kw0, d=poisoned(tuple(kw0["d"].shape), torch.bfloat16))
        jobs.append(Job(name, make, ("d",), "gemm"))
    for mode in modes:
        for tokens, det in ((77, True), (77, False), (5, True)):
            dev = on_device(fused_case_np(mode, tokens, 4, 16, 256, 256, seed=tokens, out_of_range=2))

            def make(dev=dev, det=det):
                return dict(dev, out=poisoned((dev["x"].shape[0], 256), torch.bfloat16), deterministic=det)
            jobs.append(Job(f"fused_{mode}_t{tokens}_{'det' if det else 'fusedfin'}", make, ("out",), "fused",
                            exact=det, mode=mode))
    bad = on_device(fused_case_np("w4a8_int4", 5, 2, 8, seed=3))
    jobs.append(Job("fused_out_aliases_x", lambda: dict(bad, out=bad["x"]), (), "fused", fails=True))
    return jobs


def run_threads(jobs, rounds, tuning):
    results, errors = [], []

    def worker(tid):
        try:
            stream = torch.cuda.Stream()
            rng = random.Random(tid)
            with torch.cuda.stream(stream), tune.autotune(tuning):
                for _ in range(rounds):
                    order = list(jobs)
                    rng.shuffle(order)
                    for job in order:
                        results.append((job, job.run()))
            stream.synchronize()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(tid,)) for tid in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a worker thread hangs (deadlock?)"
    torch.cuda.synchronize()
    if errors:
        raise errors[0]
    return results


@pytest.fixture
def fresh_tuner(monkeypatch):
    monkeypatch.setattr(tune, "_default", new_tuner(tune))


def test_concurrent_threads_match_serial(fresh_tuner):
    jobs = concurrency_jobs(available_modes())
    serial = {job.name: job.run() for job in jobs}
    torch.cuda.synchronize()
    results = run_threads(jobs, 1 if SANITIZER else 4, tuning=False)
    assert len(results) == 2 * len(jobs) * (1 if SANITIZER else 4)
    for job, got in results:
        assert job.same(got, serial[job.name]), f"{job.name}: threaded result differs from the serial one"


def test_concurrent_autotune_cache_filled_from_both_threads(fresh_tuner, capsys):
    """Both threads tune at once (tune.autotune is per thread): every key is profiled once, a thread
    asking for a key the other is profiling waits for its winner; afterwards a serial replay with the
    cached winners gives each deterministic result bit for bit."""
    jobs = [j for j in concurrency_jobs(("w4a8_int4",)) if j.op != "mm_data"]
    results = run_threads(jobs, 1 if SANITIZER else 2, tuning=True)
    entries = tune.default_tuner().entries()
    report(capsys, "autotune entries filled by two threads: "
           + json.dumps({k: v["tactic"] for k, v in sorted(entries.items())}))
    expected = set()
    for job in jobs:
        if job.op == "gemm":
            kw = job.make()
            expected.add("w4a8_moe_mm::" + tune.moe_mm_key(kw["a"].shape[0], kw["d"].shape[1], kw["a"].shape[1],
                                                            kw["experts_offsets"].shape[0], 8, False))
        elif job.op == "fused" and not job.fails:
            kw = job.make()
            tokens = kw["x"].shape[0]
            if kw["deterministic"]:  # tuned only among the heuristic's MMA family: nothing to time with one member
                rows = max(tokens, 1) * 4
                family = tune.mma_family(qmoe.select_tactic(2 * 256, 256, rows, 16, 4), "w4a8_int4")
                candidates = tune.fused_moe_candidates(tokens, 256, 256, True, 16, 4, "w4a8_int4")
                if sum(tune.mma_family(t, "w4a8_int4") == family for t in candidates) < 2:
                    continue
            expected.add("fused_moe::" + tune.fused_moe_key(
                kw["x"].shape[0], quant_mode="w4a8_int4", hidden=256, inter=256, num_experts=16, num_local_experts=16,
                topk=4, activation="swiglu", gate_up_layout="gate_up", deterministic=kw["deterministic"],
                x_dtype="bfloat16", out_dtype="bfloat16"))
    assert set(entries) == expected, sorted(set(entries) ^ expected)
    serial = {job.name: job.run() for job in jobs}  # one thread, tuning off: the cached winners
    torch.cuda.synchronize()
    for job, got in results:
        assert job.same(got, serial[job.name]), f"{job.name}: tuned threaded result differs from serial"


# ------------------------------------------------------------------------------------------------
# item 6: faults
# ------------------------------------------------------------------------------------------------
def test_fault_validation_errors_recover_and_leak_nothing(capsys):
    """Every refused mutation of the three ops, and after each a fused call with a bad tactic (refused
    by the C++ op after ops.fused_moe allocated the workspace); every 8th step a valid call, which
    must give the first valid result bit for bit. No byte of device memory may stay allocated."""
    if SANITIZER:
        # Measured: exact under a plain run, +23 MB on the second pass under memcheck (the tool's own
        # bookkeeping of torch's allocations), so the byte count is only meaningful without it.
        pytest.skip("device byte counts are not exact under compute-sanitizer")
    baselines = {}
    for op in ("mm_data", "gemm", "fused"):
        kw = build(op, "w4a8_int4", 100)
        OPS[op].run(kw)
        baselines[op] = [kw[o].clone() for o in OPS[op].outputs]
    fused = fused_kw("w4a8_int4", 101)
    qmoe.fused_moe(**fused)
    kw = valid = None
    labels = [(op, lab) for op in ("mm_data", "gemm", "fused") for lab in mutation_labels(op, "w4a8_int4")
              if not lab.startswith("cuda1")]
    expected_refusals, refused = 0, 0
    # Two identical passes: a refused call that leaked (a workspace, a scratch tensor) would make the
    # second pass end with more live bytes than the first. (Comparing with the bytes before the
    # first pass is not exact: the first pass also frees tensors built above, and frames of caught
    # exceptions may outlive a call until the collector runs.)
    live = []
    for _ in range(2):
        for i, (op, label) in enumerate(labels):
            kw, (expect, _) = mutate(op, build(op, "w4a8_int4", stable_seed(label)), label)
            if expect == "error":
                expected_refusals += 1
                try:
                    OPS[op].run(kw)
                except (ValueError, TypeError):
                    refused += 1
            expected_refusals += 1
            try:
                qmoe.fused_moe(**dict(fused, tactic="decode_m1_n1_k1"))
            except ValueError:
                refused += 1
            kw = None
            if i % 8 == 0:
                valid = build(op, "w4a8_int4", 100)
                OPS[op].run(valid)
                for o, want in zip(OPS[op].outputs, baselines[op]):
                    assert same_bits(valid[o], want), f"after {label}: the valid call differs"
                valid = None
        gc.collect()
        torch.cuda.synchronize()
        live.append(live_bytes())
    report(capsys, f"fault_validation: {refused} refused calls, device bytes allocated after pass 1 / 2: {live}")
    assert refused == expected_refusals
    assert live[1] <= live[0], f"{live[1] - live[0]} bytes of device memory leaked by one pass of refused calls"


@pytest.mark.skipif(bool(SANITIZER), reason="provokes CUDA API errors on purpose")
def test_fault_allocator_refusal_and_foreign_cuda_errors(capsys):
    """(1) ops.fused_moe's workspace allocation refused by torch's allocator (memory fraction):
    OutOfMemoryError before any launch, output untouched, nothing leaked. (2) A failed cudaMalloc
    (1 PiB) and (3) a stale non-sticky error left by another library (cudaHostUnregister of
    unregistered memory): the first qmoe call after (3) may report the stale error (printed), the
    next one must give the baseline bit for bit."""
    kw = fused_kw("w4a8_int4", 200, tokens=4096, top_k=8, experts=16)  # a workspace of ~60 MB
    qmoe.fused_moe(**kw)
    want = kw["out"].clone()
    kw["out"] = poisoned(tuple(want.shape), torch.bfloat16)
    torch.cuda.empty_cache()
    before = live_bytes()
    total = torch.cuda.get_device_properties(DEV).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved() + (1 << 20)) / total))
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError):
            qmoe.fused_moe(**kw)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert bool(torch.isnan(kw["out"].float()).all()), "output written although the workspace was refused"
    assert live_bytes() == before
    with pytest.raises(torch.cuda.OutOfMemoryError):
        torch.empty(1 << 50, dtype=torch.uint8, device=DEV)
    qmoe.fused_moe(**kw)
    assert same_bits(kw["out"], want), "wrong result after a failed cudaMalloc"
    outs = [poisoned(tuple(want.shape), torch.bfloat16) for _ in range(2)]  # allocated before the stale error
    torch.cuda.synchronize()
    host = np.zeros(4096, np.uint8)
    code = torch.cuda.cudart().cudaHostUnregister(host.ctypes.data)
    assert int(code) != 0, "cudaHostUnregister of unregistered memory unexpectedly succeeded"
    try:
        qmoe.fused_moe(**dict(kw, out=outs[0]))
        torch.cuda.synchronize()
        first = "succeeded" + (" (bitwise right)" if same_bits(outs[0], want) else " (WRONG result)")
    except RuntimeError as e:
        first = f"raised: {e}"
    report(capsys, f"fault_foreign_error: first qmoe call after a stale cudaErrorHostMemoryNotRegistered {first}")
    assert "WRONG" not in first
    qmoe.fused_moe(**dict(kw, out=outs[1]))
    assert same_bits(outs[1], want), "wrong result on the second call after a stale foreign error"
    outs = None
    assert live_bytes() == before
    # qmoe links its own (static) CUDA runtime, so the stale error is still pending in torch's: torch's
    # next kernel-launch check reports it (and reading it clears it). Consume it here, so that it does
    # not fail whichever test runs next.
    try:
        torch.ones(1, device=DEV).add_(1)
    except Exception:  # noqa: BLE001 - the stale cudaErrorHostMemoryNotRegistered, expected once
        pass
    assert float(torch.ones(1, device=DEV).add_(1)) == 2.0


INJECTION_CHILD = r"""
import json, os, sys
import numpy as np, torch, qmoe
sys.path.insert(0, os.environ["QMOE_TEST_DIR"])
import gpu_reliability_common as C

stats, stages, det_bits = {}, set(), [None]


def attempt(name, fn):
    s = stats.setdefault(name, {"ok": 0, "injected": 0})
    try:
        fn()
        s["ok"] += 1
    except RuntimeError as e:  # anything but the injected error fails the child
        if "QMOE_TEST_FAIL_LAUNCH" not in str(e):
            raise
        s["injected"] += 1
        stages.add(str(e).split("'")[1])


def gemm_job(name):
    e, n, k, counts, per_row = C.GEMM_ODD[name]
    kw0, mask, full = C.gemm_kw(C.stable_seed(name), e, n, k, counts, per_row=per_row)
    want, m = C.gemm_cpu(kw0, full), C.to_np(mask)

    def run():
        kw = dict(kw0, d=C.poisoned(tuple(kw0["d"].shape), torch.bfloat16))
        C.sgl.cutlass_w4a8_moe_mm(**kw)
        torch.cuda.synchronize()
        C.testing.assert_close(C.to_np(kw["d"])[m], want[m], "grouped_gemm")
    return run


def fused_job(det):
    case = C.fused_case_np("w4a8_int4", 33, 6, 12, 384, 640, seed=5, out_of_range=3)
    want, dev = qmoe.fused_moe(**case, deterministic=det), C.on_device(case)

    def run():
        out = qmoe.fused_moe(**dev, deterministic=det)
        torch.cuda.synchronize()
        C.testing.assert_close(C.to_np(out), want, "w4a8_int4")
        if det:
            bits = C.raw(out).cpu()
            det_bits[0] = bits if det_bits[0] is None else det_bits[0]
            assert torch.equal(bits, det_bits[0]), "the deterministic result changed after injected failures"
    return run


def mm_data_job(tokens, experts):
    want = C.ref.moe_mm_data(C.to_np(C.mm_data_kw(6, tokens, 8, experts)["topk_ids"]), experts, 72, 384)

    def run():
        kw = C.mm_data_kw(6, tokens, 8, experts)
        C.OPS["mm_data"].run(kw)
        torch.cuda.synchronize()
        for o in C.OPS["mm_data"].outputs:
            np.testing.assert_array_equal(C.to_np(kw[o]), want[o], err_msg=o)
    return run


jobs = {"gemm_" + n: gemm_job(n) for n in ("tiny_e3_n72_k384", "small_e5_n200_k640")}
jobs.update(fused_det=fused_job(True), fused_fusedfin=fused_job(False), mm_data=mm_data_job(700, 64),
            mm_data_multi_cta=mm_data_job(4099, 300))
jitter = mm_data_job(3, 4)
rng = np.random.default_rng(int(os.environ["QMOE_TEST_FAIL_LAUNCH"]))
base = None
for it in range(int(os.environ["QMOE_ITERATIONS"])):
    for name, run in jobs.items():
        for _ in range(int(rng.integers(0, 3))):  # moves where the n-th checks land from round to round
            attempt("jitter", jitter)
        attempt(name, run)
    if it == 1:
        base = C.live_bytes()
torch.ones(1, device="cuda").add_(1)
end = C.live_bytes()
print("RESULT " + json.dumps(dict(stats=stats, stages=sorted(stages), base=base, end=end)))
"""


@pytest.mark.parametrize("period", [1, 3, 11, 29])
def test_fault_injected_launch_errors(period, capsys):
    """QMOE_TEST_FAIL_LAUNCH=n (test hook in src/cuda/common/cuda_check.cu) makes every n-th CUDA check
    of the process throw, so failures land in every stage of every op. In a child process: each call
    gives the right result or raises the injected error (anything else fails); the deterministic
    result never changes; no device memory leaks; the context stays healthy (a torch op and a
    synchronize at the end). n = 1: every call fails; n >= 11: at least half of the ops also succeed."""
    rounds = "8" if SANITIZER == "racecheck" else "30"  # racecheck: each round is slow (not timed yet)
    env = dict(os.environ, QMOE_TEST_FAIL_LAUNCH=str(period), QMOE_ITERATIONS=rounds,
               QMOE_TEST_DIR=os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", INJECTION_CHILD], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    report(capsys, f"fault_injection period={period}: {json.dumps(result)}")
    injected = sum(s["injected"] for s in result["stats"].values())
    assert injected > 0, "QMOE_TEST_FAIL_LAUNCH had no effect: the library lacks the test hook (cuda_check.cu)"
    if not SANITIZER:  # torch's byte count is not exact under compute-sanitizer (see the test above)
        assert result["end"] == result["base"], f"{result['end'] - result['base']} bytes leaked"
    if period == 1:
        assert all(s["ok"] == 0 for s in result["stats"].values()), result
    if period >= 11:
        # Ops must also succeed between injected failures. Not necessarily every op: one whose number of
        # CUDA checks per call is a multiple of the period (and whose calls start in phase) can fail
        # on every call by construction; that is arithmetic, not a library fault (the child already
        # checked that every call either raised the injected error or returned the right bits).
        succeeded = [name for name, st in result["stats"].items() if st["ok"] > 0]
        assert len(succeeded) >= len(result["stats"]) // 2, result
        assert len(result["stages"]) >= 3, f"failures landed in too few stages: {result['stages']}"
