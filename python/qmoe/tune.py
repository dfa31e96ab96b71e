"""qmoe's autotuner: which compiled W4A8 grouped-GEMM tactic is fastest for one problem, measured
once per token bucket and remembered (in memory, and in a JSON file when asked).

    with qmoe.tune.autotune(True, cache="qmoe_tactics.json"):
        qmoe.fused_moe(...)          # first call of each (problem, bucket) times every valid tactic
    qmoe.fused_moe(...)              # later calls (any thread) use the cached winner

Rules (docs/design.md, "Tactics and autotuning"):
- A forced `tactic=` always wins; the tuner is not consulted. Without a cached winner and outside
  tuning mode the op uses the pure heuristic (qmoe.select_tactic): choose() returns None.
- Only CUDA tensors are tuned (the CPU reference has no tactics), and never while a CUDA graph is
  being captured (timing would launch and synchronize inside the capture): then a cached winner is
  used if there is one, else the heuristic.
- Problem key: the op name, the token bucket, and every argument that changes the kernels that run
  (GEMM shapes, experts, top_k, activation, finalize mode, dtypes; see fused_moe_key and
  moe_mm_key). Scalar values (swiglu alpha/beta/limit, routed_scaling_factor) are left out: they
  change no launch. The in-memory cache holds one GPU model per process.
- Token buckets are FlashInfer's "hybrid" ones: powers of 2 up to 256, steps of 256 up to 2048,
  steps of 512 up to 4096, then powers of 2; a runtime count maps UP to the next bucket. The first
  call that falls in a bucket is the one profiled, with its own tensors (no synthetic inputs, so
  the routing skew measured is the real one).
- Thread safety: the cache is guarded by a lock; a key is profiled by one thread at a time (a
  second thread asking for the same key waits for the result), and profiling of different keys is
  serialized so that two threads' timings do not overlap on the GPU. The "tuning on" flag is
  thread-local, as in FlashInfer.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import tempfile
import threading
import warnings
from typing import Callable, Dict, Optional, Sequence

from . import _C

try:  # torch is optional: without it nothing is a CUDA tensor, so nothing is tuned
    import torch
except ImportError:  # pragma: no cover - exercised on machines without torch
    torch = None

FILE_FORMAT = 1
# Hybrid bucket edges (FlashInfer's): fine where decode timings change fast, coarse for prefill.
_SMALL_POW2_MAX = 256
_LINEAR_STEPS = ((2048, 256), (4096, 512))


def token_buckets(max_tokens: int = 1 << 20) -> list:
    """Every bucket up to max_tokens (inclusive of the bucket that holds max_tokens)."""
    out, b = [], 1
    while True:
        out.append(b)
        if b >= max_tokens:
            return out
        b = bucket(b + 1)


def bucket(num_tokens: int) -> int:
    """The smallest bucket >= num_tokens (0 maps to 1: an empty batch runs the decode tactics)."""
    t = max(int(num_tokens), 1)
    if t <= _SMALL_POW2_MAX:
        return 1 << (t - 1).bit_length()
    low = _SMALL_POW2_MAX
    for limit, step in _LINEAR_STEPS:
        if t <= limit:
            return low + step * math.ceil((t - low) / step)
        low = limit
    return 1 << (t - 1).bit_length()


def problem_key(num_tokens: int, **fields) -> str:
    """A stable, readable key: 'bucket=B,field=value,...' with the fields sorted by name. Values are
    rendered with str(), so pass ints, strings and bools only (no floats: they need no key)."""
    for name, value in fields.items():
        if not isinstance(value, (int, str, bool)):
            raise TypeError(f"qmoe: argument '{name}': expected an int, str or bool key field, got {value!r}")
    parts = [f"bucket={bucket(num_tokens)}"] + [f"{k}={fields[k]}" for k in sorted(fields)]
    return ",".join(parts)


def moe_mm_key(rows: int, n: int, k: int, num_experts: int, topk: int, per_row_scales: bool) -> str:
    """Key of cutlass_w4a8_moe_mm. Its dynamic dimension is the row count R of `a` (tokens x top_k
    in SGLang's layout), so R is what is bucketed. dtypes are fixed by the op (e4m3 x int4 -> bf16);
    the scale layout follows from K; per-row activation scales change the epilogue."""
    return problem_key(rows, n=int(n), k=int(k), experts=int(num_experts), topk=int(topk),
                       a_scales="per_row" if per_row_scales else "scalar")


def fused_moe_key(num_tokens: int, *, quant_mode: str, hidden: int, inter: int, num_experts: int,
                  num_local_experts: int, topk: int, activation: str, gate_up_layout: str,
                  deterministic: bool, x_dtype: str, out_dtype: str, fp4_weights_packed: bool = False) -> str:
    """Key of qmoe.fused_moe: both GEMMs' shapes (H, I, gated or not), the routing fan-out (E, local
    experts, top_k), the finalize mode, the dtypes of x (bf16 quantized inside vs e4m3) and out, and (only
    when set, so that plain-weight keys keep their text) packed FP4 weights, whose decode costs differ."""
    packed = {"weights": "fp4_packed"} if fp4_weights_packed else {}
    return problem_key(num_tokens, quant_mode=quant_mode, hidden=int(hidden), inter=int(inter),
                       experts=int(num_experts), local_experts=int(num_local_experts), topk=int(topk),
                       activation=activation, gate_up_layout=gate_up_layout,
                       finalize="deterministic" if deterministic else "fused", x_dtype=x_dtype,
                       out_dtype=out_dtype, **packed)


# --------------------------------------------------------------------------------------------
# Default timer and guards (CUDA only; replaced by fakes in the CPU tests)

_flush_lock = threading.Lock()
_flush_buffers: Dict[int, object] = {}


def _l2_flush_buffer(device):
    """A byte buffer twice the L2 size (zeroing it evicts the previous run's weights: ~30 us on
    H200's 60 MB L2, cheap next to a profile). One per device, made once."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _flush_lock:
        buf = _flush_buffers.get(index)
        if buf is None:
            l2 = getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0) or (64 << 20)
            buf = torch.empty(2 * l2, dtype=torch.uint8, device=f"cuda:{index}")
            _flush_buffers[index] = buf
    return buf


def cuda_event_timer(fn: Callable[[], None], *, warmup: int = 2, repeats: int = 5, flush_l2: bool = True) -> float:
    """Median milliseconds of fn() on the current CUDA stream, timed with CUDA events after
    `warmup` runs, the L2 flushed before each timed run (decode-sized weights would otherwise sit
    in L2 and favour the tactic that reads them twice)."""
    stream = torch.cuda.current_stream()
    flush = _l2_flush_buffer(stream.device) if flush_l2 else None
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _capturing() -> bool:
    """True while the current CUDA stream is capturing a graph (profiling must not happen then)."""
    if torch is None or not torch.cuda.is_available():
        return False
    return bool(torch.cuda.is_current_stream_capturing())


def current_metadata() -> dict:
    """What a cache file must match to be used: qmoe version, the compiled tactic list, the GPU
    and the CUDA runtime (torch's, the one the caller's process runs with)."""
    gpu = cuda = None
    if torch is not None and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(torch.cuda.current_device())
        cuda = torch.version.cuda
    return {"library": "qmoe", "qmoe_version": _C.__version__, "format": FILE_FORMAT, "gpu": gpu,
            "cuda_runtime": cuda, "tactics": list(_C.valid_tactics(256, 256, 64, 8))}


# --------------------------------------------------------------------------------------------
# The tuner

_thread_state = threading.local()


def tuning_enabled() -> bool:
    """Whether this thread is inside autotune(True)."""
    return bool(getattr(_thread_state, "tune", False))


class Tuner:
    """Cache of winners (key -> entry) and the profiling of misses. timer(fn) -> time of fn()
    (any unit, smaller is faster); capturing() -> bool; metadata() -> dict (see current_metadata)."""

    def __init__(self, timer: Optional[Callable] = None, capturing: Optional[Callable[[], bool]] = None,
                 metadata: Optional[Callable[[], dict]] = None):
        self.timer = timer or cuda_event_timer
        self.capturing = capturing or _capturing
        self.metadata = metadata or current_metadata
        self._lock = threading.Lock()          # guards _entries and _in_flight
        self._profile_lock = threading.RLock()  # one profile at a time: timings must not overlap
        self._entries: Dict[str, dict] = {}
        self._in_flight: Dict[str, tuple] = {}  # key -> (owner thread id, threading.Event)

    # ---- cache ----------------------------------------------------------------------------
    def lookup(self, op: str, key: str) -> Optional[str]:
        with self._lock:
            entry = self._entries.get(f"{op}::{key}")
        return None if entry is None else entry["tactic"]

    def idle(self) -> bool:
        """Nothing cached and this thread not tuning: every choice is the heuristic (the ops' fast
        path: no key to build on each call)."""
        if tuning_enabled():
            return False
        with self._lock:
            return not self._entries

    def entries(self) -> Dict[str, dict]:
        with self._lock:
            return {k: dict(v) for k, v in self._entries.items()}

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    # ---- choice ---------------------------------------------------------------------------
    def choose(self, op: str, key: str, candidates: Sequence[str], run: Callable[[str], None]) -> Optional[str]:
        """The tactic to use for (op, key): the cached winner if it is still a candidate; else, in
        tuning mode and outside graph capture, the fastest candidate (run(tactic) executes the op
        with that tactic forced; it is timed with self.timer and the winner is stored); else None
        (the caller uses its heuristic). Errors raised by run() propagate; nothing is stored then."""
        candidates = list(candidates)
        full = f"{op}::{key}"
        me = threading.get_ident()
        if tuning_enabled() and self.capturing():
            tuning = False  # NOTE: timing syncs the stream, which a graph capture forbids
        else:
            tuning = tuning_enabled()
        while True:
            with self._lock:
                entry = self._entries.get(full)
                if entry is not None and entry["tactic"] in candidates:
                    return entry["tactic"]
                if not tuning or len(candidates) < 2:
                    return None  # one candidate: the heuristic picks it anyway
                flight = self._in_flight.get(full)
                if flight is None:
                    done = threading.Event()
                    self._in_flight[full] = (me, done)
                    break
            owner, done = flight
            if owner == me:  # run() re-entered choose() for the same key: do not wait on ourselves
                return None
            done.wait()  # another thread profiles this key; then read its result
        try:
            times = self._profile(candidates, run)
            winner = min(candidates, key=lambda t: times[t])  # ties: the earlier candidate
            with self._lock:
                self._entries[full] = {"tactic": winner, "times_ms": {t: float(times[t]) for t in candidates}}
            return winner
        finally:
            with self._lock:
                del self._in_flight[full]
            done.set()

    def _profile(self, candidates, run) -> dict:
        with self._profile_lock:
            return {t: self.timer(lambda t=t: run(t)) for t in candidates}

    # ---- file -----------------------------------------------------------------------------
    def load(self, path: str) -> int:
        """Merge a cache file into memory (entries measured in this process are kept). A file whose
        _metadata differs from this process's (GPU, qmoe version, CUDA runtime, tactic list) is
        ignored with a warning. Returns the number of entries taken."""
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            return 0
        except (OSError, ValueError) as e:
            warnings.warn(f"qmoe autotune: cache file {path!r} is not readable JSON ({e}); ignored", RuntimeWarning,
                          stacklevel=3)
            return 0
        meta = data.get("_metadata") if isinstance(data, dict) else None
        want = self.metadata()
        if meta != want:
            diff = sorted(k for k in set(want) | set(meta or {}) if (meta or {}).get(k) != want.get(k))
            warnings.warn(f"qmoe autotune: cache file {path!r} was made for another setup (differs in {diff}: "
                          f"file {({k: (meta or {}).get(k) for k in diff})}, here {({k: want.get(k) for k in diff})}); "
                          "ignored", RuntimeWarning, stacklevel=3)
            return 0
        taken = 0
        with self._lock:
            for k, v in (data.get("entries") or {}).items():
                if isinstance(k, str) and isinstance(v, dict) and isinstance(v.get("tactic"), str):
                    if k not in self._entries:
                        self._entries[k] = {"tactic": v["tactic"], "times_ms": dict(v.get("times_ms") or {})}
                        taken += 1
        return taken

    def save(self, path: str) -> None:
        """Write every in-memory entry with this process's _metadata (atomically: a temporary file
        in the same folder, then os.replace, so a reader never sees half a file)."""
        data = {"_metadata": self.metadata(), "entries": dict(sorted(self.entries().items()))}
        folder = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=".qmoe_tune_", suffix=".json", dir=folder)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
                f.write("\n")
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


_default = Tuner()


def default_tuner() -> Tuner:
    return _default


def choose(op: str, key: str, candidates: Sequence[str], run: Callable[[str], None]) -> Optional[str]:
    """Tuner.choose on the process-wide tuner."""
    return _default.choose(op, key, candidates, run)


@contextlib.contextmanager
def autotune(tune_mode: bool = True, cache: Optional[str] = None):
    """FlashInfer-style context. tune_mode=True: in this thread, each new (problem, token bucket)
    is profiled once and its winner cached; tune_mode=False: nothing is profiled (cached winners
    are still used). `cache`: a JSON file loaded on entry and, with tune_mode and at least one
    entry to write, saved on exit (even if the block raised: what was measured stays measured)."""
    tuner = _default
    if cache:
        tuner.load(cache)
    previous = getattr(_thread_state, "tune", False)
    _thread_state.tune = bool(tune_mode)
    try:
        yield tuner
    finally:
        _thread_state.tune = previous
        if cache and tune_mode and tuner.entries():
            tuner.save(cache)


# --------------------------------------------------------------------------------------------
# Hooks used by the ops (CUDA tensors only; the ops call these when no tactic= is given)

def is_cuda(t) -> bool:
    return torch is not None and isinstance(t, torch.Tensor) and t.is_cuda


def _on_device(device):
    """The tensors' device made current, so that the timer's events and current_stream() are the
    ones the op runs on (a tensor on cuda:1 while cuda:0 is current)."""
    if device is None or torch is None:
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def moe_mm_tactic(rows: int, n: int, k: int, num_experts: int, topk: int, per_row_scales: bool,
                  run: Callable[[str], None], device=None) -> Optional[str]:
    """cutlass_w4a8_moe_mm's tactic from the tuner (None: heuristic)."""
    if _default.idle():
        return None
    candidates = _C.valid_tactics(n, k, rows, num_experts, topk)
    with _on_device(device):
        return choose("w4a8_moe_mm", moe_mm_key(rows, n, k, num_experts, topk, per_row_scales), candidates, run)


def fused_moe_candidates(num_tokens: int, hidden: int, inter: int, gated: bool, num_local_experts: int,
                         topk: int, quant_mode: str = "w4a8_int4") -> list:
    """Tactic names valid for both GEMMs of the fused op, in the compiled order (w4a8_int4: the W4A8
    GEMM's tactics; the other modes: the bf16 x 4-bit GEMM's)."""
    rows = max(int(num_tokens), 1) * topk
    bf16 = quant_mode != "w4a8_int4"
    gemm1 = _C.valid_tactics(2 * inter if gated else inter, hidden, rows, num_local_experts, topk, bf16)
    gemm2 = set(_C.valid_tactics(hidden, inter, rows, num_local_experts, topk, bf16))
    return [t for t in gemm1 if t in gemm2]


# The W4A8 GEMM's WGMMA tiles (src/tune/tactics.cpp) sum the fp32 products in another order than its
# mma.sync tiles, so their outputs differ in the last bits; all tactics of one family give the same bits
# (measured: tests/python/test_gpu_reliability_runtime.py).
WGMMA_TACTICS = frozenset({"prefill_m128_n160_k128", "prefill_m128_n128_k128", "prefill_m128_n96_k128",
                           "prefill_m128_n64_k128", "prefill_m128_n48_k128", "prefill_m128_n32_k128"})
# ... except the W4A8 32- and 48-token tiles, whose operands are biased codes with a bias wgmma per K step (design.md
# 6.2): a family of their own.
BIASED_WGMMA_TACTICS = frozenset({"prefill_m128_n32_k128", "prefill_m128_n48_k128"})
# ... and the WGMMA tiles of the bf16 x 4-bit GEMM (the other modes; its other tiles are mma.sync).
BF16_WGMMA_TACTICS = frozenset({"prefill_m128_n64_k128", "prefill_m128_n128_k128", "prefill_m128_n160_k128"})


def mma_family(tactic: str, quant_mode: str) -> str:
    """'wgmma', 'wgmma.biased' or 'mma.sync': tactics of one family give bitwise-identical results (per GEMM
    kernel: the W4A8 GEMM of w4a8_int4, the bf16 x 4-bit GEMM of the other modes)."""
    if quant_mode == "w4a8_int4":
        return ("wgmma.biased" if tactic in BIASED_WGMMA_TACTICS else "wgmma" if tactic in WGMMA_TACTICS
                else "mma.sync")
    return "wgmma" if tactic in BF16_WGMMA_TACTICS else "mma.sync"


def fused_moe_tactic(num_tokens: int, *, quant_mode: str, hidden: int, inter: int, gated: bool, num_experts: int,
                     num_local_experts: int, topk: int, activation: str, gate_up_layout: str, deterministic: bool,
                     x_dtype: str, out_dtype: str, run: Callable[[str], None], device=None,
                     fp4_weights_packed: bool = False) -> Optional[str]:
    """fused_moe's tactic from the tuner (None: heuristic). One name serves both GEMMs, so the
    candidates are the tactics valid for both (GEMM1: N = 2I or I, K = H; GEMM2: N = H, K = I), with
    the problem sizes the C++ side uses (rows = T * top_k, experts = local experts). With the
    deterministic finalize only tactics of the heuristic's MMA family are candidates, so that tuning
    never changes the bits a deterministic call returns."""
    if _default.idle():
        return None
    candidates = fused_moe_candidates(num_tokens, hidden, inter, gated, num_local_experts, topk, quant_mode)
    if deterministic:
        rows = max(int(num_tokens), 1) * topk
        heuristic = _C.select_tactic(2 * inter if gated else inter, hidden, rows, num_local_experts, topk,
                                     quant_mode != "w4a8_int4", quant_mode not in ("w4a8_int4", "w4a16_int4"))
        family = mma_family(heuristic, quant_mode)
        candidates = [t for t in candidates if mma_family(t, quant_mode) == family]
    key = fused_moe_key(num_tokens, quant_mode=quant_mode, hidden=hidden, inter=inter, num_experts=num_experts,
                        num_local_experts=num_local_experts, topk=topk, activation=activation,
                        gate_up_layout=gate_up_layout, deterministic=deterministic, x_dtype=x_dtype,
                        out_dtype=out_dtype, fp4_weights_packed=fp4_weights_packed)
    with _on_device(device):
        return choose("fused_moe", key, candidates, run)
