"""Expert parallelism (docs/expert-parallel.md): one MoE layer over W ranks, each holding E / W experts.

Every rank brings its own tokens x [T, H] with their routing (topk_ids, topk_weights [T, k]) and gets
back the full MoE output of those tokens:

    quantize at home -> pack each token's tensors into one byte row -> plan (array ops, on the device
    for torch CUDA tensors) -> dispatch (one grouped send/recv) -> moe_expert_rows on the owner (its
    local experts only) -> combine (one bf16 row per owned slot back home) -> moe_finalize at home,
    reading the returned rows where they arrived (row_index: no gather into slot order)

Exactness: rows are formed per slot from the same numbers as on one GPU (the activation row and its
a1 travel together; a2 is static), and the home rank runs the deterministic finalize in slot order,
so EP output == qmoe.fused_moe(all experts, deterministic=True) on the rank's tokens, bit for bit
(on GPUs: with the same GEMM tactics, see forward's `tactic`).

Scale rule for w4a8_int4 (the only mode with tensor-wide dynamic scales): a1 may be static ([1]),
per token ([T]) or dynamic (None: amax over the HOME rank's x / 448, as fused_moe computes it on
that rank's tokens); the home rank quantizes and a1 travels per token. a2 (fc2_input_scale) must be
given: the dynamic a2 is the amax over the intermediate rows of all of a rank's tokens, which are
computed on several ranks, and agreeing on it would need an extra all-reduce between GEMM1 and GEMM2.

Wire format: each token is one byte row [x | per-token scales | topk_ids (int32)], padded to 16 bytes,
so a dispatch is one grouped exchange whatever the quant mode. The packed buffer has one extra pad
row (zeros, topk_ids = -1) that every unused send position copies: the owner's engine skips it.

Modes: "throughput" exchanges per-peer token and slot counts first (one small exchange and the only
host sync), then variable-size buffers; rows come back only for owned slots. "low_latency" uses
fixed buffers of max_tokens_per_rank rows per peer and sends back every slot of every received
position (fixed [C*k, H] per peer): no count exchange, no host sync, no data-dependent shape, so the
whole layer can be captured in a CUDA graph (torch CUDA tensors; NCCL transport). T >
max_tokens_per_rank is an error, never a silent drop.

Chunks (low-latency mode; docs/expert-parallel.md "Overlap"): forward(chunks=n) splits the rank's
tokens into n contiguous chunks ([c*T//n, (c+1)*T//n)) after quantizing and packing the WHOLE batch
(a dynamic a1 stays the full batch's amax). Chunk c's dispatch runs while chunk c-1's experts compute,
and chunk c-1's combine while chunk c computes: on torch CUDA tensors the exchanges go to a side CUDA
stream, ordered against the compute stream with events (fork/join, legal in graph capture); elsewhere
the same schedule runs serially (_Streams). Each chunk's exchanges have fixed per-peer capacity
ceil(max_tokens_per_rank / n) rows, so the T <= max_tokens_per_rank rule per layer call is enough
(every chunk holds at most ceil(T / n) tokens). One GEMM tactic serves every chunk: the caller's, or
the one the owner's heuristic picks for the UNCHUNKED call (W * max_tokens_per_rank received rows),
so the output is bitwise the chunks=1 output. Each token's slots live in one chunk, and the chunk's
finalize writes its rows of `out`. Default (chunks=None): 1. Chunking is opt-in until it has run on
GPUs (written after session 3's last 2-GPU run; checked on the CPU only); the throughput mode takes
chunks=1 only.

Reduced combine (forward(deterministic=False); docs/expert-parallel.md): the routing weights travel with
the payload, each owner runs qmoe.fused_moe over the tokens it received with its local experts (its own
fused finalize, routed_scaling_factor included) into one partial row per token in the output dtype, the
combine returns one row per (token, owner) instead of one per slot (k / W times fewer bytes for top-k
routing spread over W ranks), and the home sums the partials of each token in rank order in fp32,
rounded once (a scatter-add per rank into distinct rows: no data-dependent shape, graph-capturable).
Within the fused finalize's tolerance of one GPU, not bitwise (two-level sums); the C++ layers' reduced
combine computes the same thing. Unchunked only.

Engine of the unchunked low-latency mode (low_latency_engine): on torch CUDA tensors with an NCCL
transport, "cpp" (default) runs the C++ layer (include/qmoe/expert_parallel_layer.h: the same wire rules
and the same results, bitwise in deterministic mode, with a handful of kernels instead of the array
plan's dozens; measured 0.1-0.9 ms faster per layer on two H200s, docs/expert-parallel.md); "python"
keeps the array path below. Elsewhere (CPU, other transports, chunks > 1, a timeline) the array path runs.

The plan is computed with array operations (numpy for CPU arrays, torch for torch tensors: on the
GPU for CUDA tensors, no copy of the routing to the host); it matches include/qmoe/expert_parallel.h
(send order: grouped by destination, ascending token; return order: (token, slot) order), which the
CPU tests check against the C++ plan.
"""
from __future__ import annotations

import contextlib

import ml_dtypes
import numpy as np

from . import _C, ops, quant
from ._tensors import is_torch
from .sm_limit import limit_sms, sm_limit

MODES = ("throughput", "low_latency")
# The per-token payload of each quant mode, in wire order (topk_ids is appended to every mode).
_PAYLOAD = {
    "w4a8_int4": ("x", "x_scale"),
    "w4a16_int4": ("x",),
    "w4a16": ("x",),
    "w4a8": ("x", "x_scale"),
    "w4a4": ("x", "x_scale", "per_token_scale"),
}
_ROW_ALIGN = 16  # bytes: packed rows stay 16-byte aligned, so every part's copy is aligned too


# ---- array operations on numpy arrays or torch tensors (one code path for both) --------------------

class _Arrays:
    """The few array operations the EP steps need, for the framework (and device) of `like`."""

    def __init__(self, like):
        self.torch = None
        if is_torch(like):
            import torch

            self.torch, self.device = torch, like.device

    def int64(self, a):
        return a.long() if self.torch else np.asarray(a).astype(np.int64)

    def int32(self, a):
        return a.to(self.torch.int32) if self.torch else np.asarray(a).astype(np.int32)

    def arange(self, n):
        return self.torch.arange(n, device=self.device) if self.torch else np.arange(n, dtype=np.int64)

    def full(self, shape, value, dtype="int64"):
        if self.torch:
            return self.torch.full(shape, value, dtype=getattr(self.torch, dtype), device=self.device)
        return np.full(shape, value, dtype=np.dtype(dtype))

    def empty(self, shape, dtype):
        """dtype: a numpy dtype (numpy) or torch dtype (torch)."""
        if self.torch:
            return self.torch.empty(shape, dtype=dtype, device=self.device)
        return np.empty(shape, dtype=dtype)

    def uint8(self):
        return self.torch.uint8 if self.torch else np.uint8

    def where(self, cond, a, b):
        return self.torch.where(cond, a, b) if self.torch else np.where(cond, a, b)

    def cumsum0(self, a):
        return self.torch.cumsum(a, 0) if self.torch else np.cumsum(a, axis=0)

    def take_columns(self, a, columns):
        """a[i, columns[i, j]] for a [N, W], columns [N, k] (int64, in range)."""
        return a.gather(1, columns) if self.torch else np.take_along_axis(a, columns, axis=1)

    def host_ints_later(self, a):
        """A small integer array as Python ints, in two steps: this call starts the device-to-host
        copy (torch CUDA: into pinned memory, asynchronous, an event behind it) and returns a callable
        that waits for it (the host sync) and returns the ints. Work enqueued between the two steps
        keeps the GPU busy while the host waits."""
        if self.torch and a.is_cuda:
            host = self.torch.empty(a.shape, dtype=a.dtype, pin_memory=True)
            host.copy_(a, non_blocking=True)
            done = self.torch.cuda.Event()
            done.record()
            return lambda: (done.synchronize(), [int(v) for v in host.reshape(-1).tolist()])[1]
        values = [int(v) for v in (a.reshape(-1).tolist() if self.torch else np.asarray(a).reshape(-1).tolist())]
        return lambda: values

    def contiguous(self, a):
        return a.contiguous() if self.torch else np.ascontiguousarray(a)

    def byte_rows(self, a, rows):
        """a [rows, ...] (contiguous) as uint8 [rows, bytes per row]."""
        per_row = int(np.prod(a.shape[1:], dtype=np.int64)) if len(a.shape) > 1 else 1
        a = self.contiguous(a).reshape(rows, per_row)
        return a.view(self.torch.uint8) if self.torch else a.view(np.uint8)

    def from_bytes(self, b, dtype, row_shape):
        """uint8 [N, bytes] columns -> a contiguous [N, *row_shape] array of dtype."""
        b = self.contiguous(b)
        return b.view(dtype).reshape((b.shape[0],) + tuple(row_shape))


# ---- routing: which rank owns each slot, where each token and row goes ---------------------------

class _Routing:
    """The plan of include/qmoe/expert_parallel.h as arrays (no host copy): ids [T, k] int32."""

    def __init__(self, xp: _Arrays, ids, num_experts: int, world: int):
        per = num_experts // world
        self.num_tokens, self.top_k = int(ids.shape[0]), int(ids.shape[1])
        ids64 = xp.int64(ids)
        self.valid = (ids64 >= 0) & (ids64 < num_experts)                      # [T, k]
        self.owner = xp.where(self.valid, ids64 // per, xp.full(ids64.shape, -1))  # [T, k], -1 invalid
        hot = self.owner[:, :, None] == xp.arange(world)[None, None, :]         # [T, k, W]
        self.dest = hot.any(1)                                                  # [T, W] token goes to d
        self.send_counts = self.dest.sum(0)                                     # [W] tokens per peer
        self.slot_onehot = hot.reshape(self.num_tokens * self.top_k, world)     # [T*k, W]
        self.return_counts = self.slot_onehot.sum(0)                            # [W] owned slots per peer
        # Position of token t in destination d's list (ascending token order), valid where dest.
        self.position = xp.cumsum0(xp.int64(self.dest)) - 1                    # [T, W]
        self.owner_or_0 = xp.where(self.valid, self.owner, xp.full(ids64.shape, 0))

    def throughput_row_index(self, xp: _Arrays):
        """int32 [T*k]: where the row of slot s sits in the throughput combine's receive buffer (grouped
        by owner d, each group in (token, slot) order): return_offset[d] + rank of s among d's slots;
        -1 for invalid slots. Routing only: computed before any exchange."""
        flat_owner = self.owner_or_0.reshape(-1, 1)
        rank_in_owner = xp.take_columns(xp.cumsum0(xp.int64(self.slot_onehot)), flat_owner).reshape(-1) - 1
        base = xp.cumsum0(self.return_counts) - self.return_counts  # exclusive offsets per owner
        index = base[flat_owner.reshape(-1)] + rank_in_owner
        return xp.int32(xp.where(self.valid.reshape(-1), index, xp.full(index.shape, -1)))

    def low_latency_row_index(self, xp: _Arrays, capacity: int):
        """int32 [T*k]: slot (t, j) owned by d comes back at d*C*k + position(t in d's list)*k + j of
        the fixed [W*C*k, H] receive buffer; -1 for invalid slots."""
        top_k = self.top_k
        position = xp.take_columns(self.position, self.owner_or_0)  # [T, k]
        index = self.owner_or_0 * (capacity * top_k) + position * top_k + xp.arange(top_k)[None, :]
        return xp.int32(xp.where(self.valid, index, xp.full(index.shape, -1)).reshape(-1))


def _send_index(xp: _Arrays, routing: _Routing, base, total: int):
    """src [total]: the token (or T, the pad row) at each send-buffer position; token t for peer d
    sits at base[d] + position[t, d]."""
    tokens, world = routing.num_tokens, routing.dest.shape[1]
    target = xp.where(routing.dest, base[None, :] + routing.position, xp.full((tokens, world), total))
    src = xp.full((total + 1,), tokens)  # the last entry absorbs every non-destination pair
    token_of = xp.arange(tokens)[:, None] + xp.full((tokens, world), 0)
    src[target.reshape(-1)] = token_of.reshape(-1)
    return src[:total]


class _Streams:
    """Where the exchanges of a chunked forward run, in the order the caller issues them.

    Overlapped (torch CUDA tensors, a side stream given): exchange(fn) forks the side stream from
    everything queued on the compute stream so far (so the buffers fn sends are ready), runs fn (one
    transport call, which enqueues on torch's current stream) with the side stream current, and
    returns an event recorded after it; wait(event) makes later compute-stream work wait for that
    exchange only; join() makes the compute stream wait for the whole side stream (before the
    layer returns, so a CUDA-graph capture ends joined). Every buffer the side stream touches is
    allocated on the compute stream and kept alive by the caller until after join(): the caching
    allocator then never hands that memory to new compute-stream work while an exchange still
    uses it (no record_stream needed).
    Serial (numpy arrays, torch CPU tensors): fn runs now; wait and join do nothing. The chunked
    schedule (ExpertParallelMoE._forward_chunked) is the same code either way, so CPU tests run it."""

    def __init__(self, xp: _Arrays, side=None):
        self.side = side
        if side is not None:
            self.torch = xp.torch
            self.main = xp.torch.cuda.current_stream(side.device)

    def exchange(self, fn):
        if self.side is None:
            fn()
            return None
        self.side.wait_stream(self.main)
        with self.torch.cuda.stream(self.side):
            fn()
        done = self.torch.cuda.Event()
        done.record(self.side)
        return done

    def wait(self, done):
        if done is not None:
            self.main.wait_event(done)

    def join(self):
        if self.side is not None:
            self.main.wait_stream(self.side)


def chunk_bounds(num_tokens: int, chunks: int) -> list:
    """Token ranges of the chunks: chunk c holds [b[c], b[c+1]), b[c] = c*T // chunks (contiguous,
    sizes differ by at most one, empty chunks when T < chunks)."""
    return [c * num_tokens // chunks for c in range(chunks + 1)]


def chunk_capacity(max_tokens_per_rank: int, chunks: int) -> int:
    """Per-peer rows of one chunk's low-latency exchange: ceil(max_tokens_per_rank / chunks). Every
    chunk of a call with T <= max_tokens_per_rank fits: it holds at most ceil(T / chunks) tokens."""
    return -(-int(max_tokens_per_rank) // int(chunks))


def pinned_tactic(quant_mode: str, activation: str, hidden: int, inter: int, received_tokens: int, top_k: int,
                  local_experts: int):
    """The GEMM tactic the owner's heuristic picks for an unchunked moe_expert_rows call on
    received_tokens rows (include/qmoe/tactics.h select_tactic, per GEMM: GEMM1 N = 2I (I for relu2),
    K = H; GEMM2 N = H, K = I; rows = tokens * top_k slots over the local experts). One name forces
    both GEMMs, so it is returned only when the two GEMMs' picks agree; None otherwise (the caller
    then keeps one chunk: a single name would change one GEMM's tactic)."""
    from . import ops

    rows1 = inter if activation == "relu2" else 2 * inter
    bf16 = quant_mode != "w4a8_int4"
    fp4 = bf16 and quant_mode != "w4a16_int4"
    slots = int(received_tokens) * int(top_k)
    first = ops.select_tactic(rows1, hidden, slots, local_experts, top_k, bf16, fp4)
    second = ops.select_tactic(hidden, inter, slots, local_experts, top_k, bf16, fp4)
    return first if first == second else None


def _engine_takes_tactics(x) -> bool:
    """Only the GPU engine has tactics (the CPU reference refuses a tactic name)."""
    return bool(is_torch(x) and x.is_cuda)


class ExpertParallelMoE:
    """One MoE layer with experts split evenly over world_size ranks; this object is one rank.

    comm_sms: SMs a chunked forward (forward(chunks=n > 1), CUDA tensors) leaves free for NCCL's kernels
    while its experts' GEMMs run (qmoe.limit_sms); 0 lets the GEMMs fill the GPU.
    low_latency_engine: "cpp" (default) runs unchunked low-latency forwards on torch CUDA tensors with an
    NCCL transport through the C++ layer (same results, fewer kernels); "python" keeps the array path
    (module docstring). self.last_engine says which ran."""

    def __init__(self, world_size: int, rank: int, num_experts: int, *, transport, quant_mode: str = "w4a8_int4",
                 activation: str = "swiglu", gate_up_layout: str = "gate_up", routed_scaling_factor: float = 1.0,
                 output_dtype: str = "bfloat16", comm_sms: int = 16, low_latency_engine: str = "cpp",
                 fp4_weights_packed: bool = False, **activation_options):
        if quant_mode not in _PAYLOAD:
            raise ValueError(f"qmoe: argument 'quant_mode': expected one of {tuple(_PAYLOAD)}, got {quant_mode!r}")
        self.world_size, self.rank, self.num_experts = int(world_size), int(rank), int(num_experts)
        self.experts_per_rank = _C.ep_experts_per_rank(self.num_experts, self.world_size)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"qmoe: argument 'rank': expected a value in [0, {self.world_size}), got {rank}")
        if transport.world_size != self.world_size or transport.rank != self.rank:
            raise ValueError(f"qmoe: argument 'transport': expected rank {self.rank} of {self.world_size}, got rank "
                             f"{transport.rank} of {transport.world_size}")
        self.local_expert_offset = self.rank * self.experts_per_rank
        self.transport, self.quant_mode = transport, quant_mode
        self.options = dict(activation=activation, gate_up_layout=gate_up_layout, **activation_options)
        # FP4 weight modes: the local experts' w1 / w2 prepared by qmoe.quant.pack_fp4_weights (fused_moe's flag).
        self.fp4_weights_packed = bool(fp4_weights_packed)
        self.routed_scaling_factor, self.output_dtype = float(routed_scaling_factor), output_dtype
        if isinstance(comm_sms, bool) or not isinstance(comm_sms, (int, np.integer)) or int(comm_sms) < 0:
            raise ValueError(f"qmoe: argument 'comm_sms': expected an integer >= 0, got {comm_sms!r}")
        # SMs a chunked forward leaves free for NCCL's kernels while the experts' GEMMs run (qmoe.limit_sms):
        # a GEMM grid that fills every SM keeps a concurrent exchange from starting until it ends.
        self.comm_sms = int(comm_sms)
        if low_latency_engine not in ("cpp", "python"):
            raise ValueError(f"qmoe: argument 'low_latency_engine': expected 'cpp' or 'python', got "
                             f"{low_latency_engine!r}")
        self.low_latency_engine = low_latency_engine
        self.last_engine = None  # "cpp" or "python": what the last forward ran (tests, benchmark)
        self.last_chunks, self.last_tactic = None, None  # what the last forward used (tests, benchmark)
        self._side_streams = {}  # device index -> the exchange stream of chunked forwards

    @classmethod
    def from_process_group(cls, num_experts: int, group=None, **kwargs) -> "ExpertParallelMoE":
        """Rank and world size from a torch.distributed group; an NCCL communicator built for it."""
        import torch.distributed as dist

        from .ep_transport import NcclTransport

        transport = NcclTransport.from_process_group(group)
        return cls(dist.get_world_size(group), dist.get_rank(group), num_experts, transport=transport, **kwargs)

    # ---- the layer ------------------------------------------------------------------------------

    def forward(self, x, topk_ids, topk_weights, w1, w1_scale, w2, w2_scale, *, x_scale=None,
                fc2_input_scale=None, w1_alpha=None, w2_alpha=None, per_token_scale=None, mode="throughput",
                max_tokens_per_rank=None, out=None, tactic=None, timeline=None, chunks=None, deterministic=True):
        """out [T, H] for this rank's tokens. w1 / w2 / scales / alphas: this rank's E / W experts.

        tactic: a GEMM tactic name forced on the owner's moe_expert_rows (None: the heuristic's,
        which depends on the received row count; pin it for bitwise comparisons with fused_moe).
        timeline: None, or a callable(name) the layer calls between its phases (the benchmark
        records CUDA events there: 'dispatch', 'compute', 'combine' begin after the name's call; with
        chunks > 1 the phases overlap: 'dispatch' marks the first dispatch, 'compute' the first
        chunk's experts, 'combine' the last chunk's combine, 'finalize' the last chunk's finalize).
        chunks: low-latency mode only, the same value on every rank: None or 1 (one exchange each
        way, no side stream; the default until chunking has been measured on GPUs), or n > 1.
        With tactic=None and n > 1 every chunk runs the tactic the heuristic picks for the unchunked
        call (pinned_tactic; where its two GEMMs would differ, the layer keeps one chunk), so the
        result is bitwise the chunks=1 result. self.last_chunks / self.last_tactic: what the last
        call used (the tactic it pinned, also on the CPU, whose engine takes none).
        deterministic: True (default): per-slot rows come back and the home's fixed-order finalize makes
        the output bitwise fused_moe(deterministic=True) on one GPU; False: the reduced combine (module
        docstring), fewer bytes, within tolerance of one GPU; chunks must then be None or 1."""
        if mode not in MODES:
            raise ValueError(f"qmoe: argument 'mode': expected one of {MODES}, got {mode!r}")
        if len(getattr(topk_ids, "shape", ())) != 2:
            raise ValueError(f"qmoe: argument 'topk_ids': expected [T, k], got shape {getattr(topk_ids, 'shape', ())}")
        if is_torch(x) != is_torch(topk_ids):
            raise TypeError("qmoe: argument 'topk_ids': expected the framework of x (numpy arrays or torch tensors "
                            "together), got a mix")
        num_tokens, top_k = int(topk_ids.shape[0]), int(topk_ids.shape[1])
        if mode == "low_latency":
            if max_tokens_per_rank is None:
                raise ValueError("qmoe: argument 'max_tokens_per_rank': expected the fixed per-peer capacity of "
                                 "the low-latency mode, got None")
            _C.ep_check_low_latency_capacity(num_tokens, int(max_tokens_per_rank))  # before any exchange
        elif max_tokens_per_rank is not None:
            raise ValueError("qmoe: argument 'max_tokens_per_rank': expected None in mode 'throughput' (it sizes the "
                             f"low-latency buffers), got {max_tokens_per_rank}")
        chunks = self._resolve_chunks(chunks, mode, max_tokens_per_rank)
        if not isinstance(deterministic, (bool, np.bool_)):
            raise TypeError(f"qmoe: argument 'deterministic': expected a bool, got {deterministic!r}")
        reduce = not deterministic
        if reduce and chunks > 1:
            raise ValueError(f"qmoe: argument 'chunks': expected None or 1 with deterministic=False (the reduced "
                             f"combine runs unchunked), got {chunks}")
        self.last_tactic = tactic
        if chunks > 1:
            if len(getattr(w2, "shape", ())) != 3:
                raise ValueError(f"qmoe: argument 'w2': expected [E_local, H, I/2], got shape "
                                 f"{tuple(getattr(w2, 'shape', ()))}")
            hidden, inter = int(w2.shape[1]), 2 * int(w2.shape[2])
            if out is not None and tuple(out.shape) != (num_tokens, hidden):  # before any exchange
                raise ValueError(f"qmoe: argument 'out': expected shape ({num_tokens}, {hidden}), got "
                                 f"{tuple(out.shape)}")
            if tactic is None:
                self.last_tactic = pinned_tactic(self.quant_mode, self.options["activation"], hidden, inter,
                                                 self.world_size * int(max_tokens_per_rank), top_k,
                                                 self.experts_per_rank)
                if self.last_tactic is None:
                    chunks = 1  # the two GEMMs' heuristic tactics differ: one name cannot pin both
        self.last_chunks = chunks
        # The reduced combine sends the weights, a chunked forward finalizes between exchanges: either way a
        # bad shape must be refused now, before any exchange leaves a peer waiting.
        if (reduce or chunks > 1) and tuple(getattr(topk_weights, "shape", ())) != (num_tokens, top_k):
            raise ValueError(f"qmoe: argument 'topk_weights': expected shape ({num_tokens}, {top_k}), got "
                             f"{tuple(getattr(topk_weights, 'shape', ()))}")
        mark = timeline if timeline is not None else (lambda name: None)
        xp = _Arrays(x)
        ids = topk_ids.to(xp.torch.int32).contiguous() if xp.torch else np.ascontiguousarray(topk_ids, np.int32)
        if chunks > 1:
            engine_tactic = tactic if tactic is not None else (
                self.last_tactic if _engine_takes_tactics(x) else None)
            payload = self._quantize(x, x_scale, fc2_input_scale, per_token_scale, num_tokens)  # whole batch
            payload["topk_ids"] = ids
            packed, layout = self._pack(xp, payload, num_tokens)
            if out is None:
                out = ops.empty_like_framework(x, (num_tokens, hidden), ops._dtype_name(self.output_dtype))
            # The finalize runs per chunk between exchanges, where an argument error would leave the
            # peers waiting: check its arguments now on zero tokens (dtypes, devices, shapes).
            ops.moe_finalize(ops.empty_like_framework(x, (0, hidden), "bfloat16"), ids[:0], topk_weights[:0],
                             num_experts=self.num_experts, routed_scaling_factor=self.routed_scaling_factor,
                             output_dtype=self.output_dtype, out=out[:0])
            weights = (w1, w1_scale, w2, w2_scale, w1_alpha, w2_alpha, fc2_input_scale)
            return self._forward_chunked(xp, x, ids, topk_weights, packed, layout, weights, int(max_tokens_per_rank),
                                         chunks, engine_tactic, out, mark)
        self.last_engine = "python"
        tensors = (x, topk_weights, w1, w1_scale, w2, w2_scale, x_scale, fc2_input_scale, w1_alpha, w2_alpha,
                   per_token_scale)
        if (mode == "low_latency" and self.low_latency_engine == "cpp" and timeline is None and xp.torch
                and getattr(self.transport, "comm", None) is not None
                and all(t is None or (is_torch(t) and t.is_cuda) for t in tensors)):
            self.last_engine = "cpp"
            return self._low_latency_cpp(x, ids, topk_weights, w1, w1_scale, w2, w2_scale, x_scale, fc2_input_scale,
                                         w1_alpha, w2_alpha, per_token_scale, int(max_tokens_per_rank), out, tactic,
                                         deterministic)
        routing = _Routing(xp, ids, self.num_experts, self.world_size)
        if mode == "throughput":
            # The count exchange goes first and the host waits for it only after the quantize and
            # pack are enqueued: the GPU works on those while the host waits (the layer's one sync).
            counts_later = self._exchange_counts(xp, routing)
            row_index = routing.throughput_row_index(xp)
            # Send order for the largest possible total (T*W); the true total is a prefix of it.
            send_base = xp.cumsum0(routing.send_counts) - routing.send_counts  # exclusive offsets
            send_src = _send_index(xp, routing, send_base, num_tokens * self.world_size)
        else:
            row_index = routing.low_latency_row_index(xp, int(max_tokens_per_rank))
        payload = self._quantize(x, x_scale, fc2_input_scale, per_token_scale, num_tokens)
        if reduce:  # the owners apply the routing weights
            payload["topk_weights"] = (topk_weights.to(xp.torch.float32).contiguous() if xp.torch
                                       else np.ascontiguousarray(topk_weights, np.float32))
        payload["topk_ids"] = ids
        packed, layout = self._pack(xp, payload, num_tokens)

        mark("dispatch")
        if mode == "throughput":
            counts = counts_later()
            total = sum(counts["send_tokens"])
            recv = self._dispatch_throughput(xp, packed, send_src, counts)
            token_of_row, groups = send_src[:total], counts["send_tokens"]
        else:
            capacity = int(max_tokens_per_rank)
            recv, token_of_row = self._dispatch_low_latency(xp, packed, routing, capacity)
            counts, groups = None, [capacity] * self.world_size
        received = self._unpack(xp, recv, layout)
        mark("compute")
        if reduce:
            partial = self._owner(received, w1, w1_scale, w2, w2_scale, w1_alpha, w2_alpha, fc2_input_scale, tactic,
                                  reduce=True)
            mark("combine")
            back_counts = counts["recv_tokens"] if mode == "throughput" else groups
            back = self._exchange(xp, partial, back_counts, groups, (partial.shape[1],), partial.dtype)
            mark("finalize")
            result = self._sum_partials(xp, back, token_of_row, groups, num_tokens, out)
            mark("end")
            return result
        rows = self._owner(received, w1, w1_scale, w2, w2_scale, w1_alpha, w2_alpha, fc2_input_scale, tactic)
        mark("combine")
        if mode == "throughput":
            back = self._combine_throughput(xp, rows, received["topk_ids"], counts)
        else:
            back = self._combine_low_latency(xp, rows, int(max_tokens_per_rank))
        mark("finalize")
        # The returned rows are read where they arrived (row_index), not gathered into slot order.
        result = ops.moe_finalize(back, ids, topk_weights, num_experts=self.num_experts,
                                  routed_scaling_factor=self.routed_scaling_factor, output_dtype=self.output_dtype,
                                  out=out, row_index=row_index)
        mark("end")
        return result

    __call__ = forward

    # ---- chunks (low-latency mode): dispatch / experts / combine / finalize pipelined ------------

    def _resolve_chunks(self, chunks, mode, max_tokens_per_rank) -> int:
        """The chunk count of this call, validated before any exchange (every rank must get the same)."""
        if chunks is None:
            return 1
        if isinstance(chunks, bool) or not isinstance(chunks, (int, np.integer)) or int(chunks) < 1:
            raise ValueError(f"qmoe: argument 'chunks': expected an integer >= 1 or None, got {chunks!r}")
        if mode == "throughput" and int(chunks) != 1:
            raise ValueError(f"qmoe: argument 'chunks': expected 1 or None in mode 'throughput' (chunks overlap "
                             f"the low-latency mode's exchanges only), got {chunks}")
        return int(chunks)

    def _side_stream(self, x):
        """The layer's exchange stream on x's device (created once per device), or None off the GPU."""
        if not (is_torch(x) and x.is_cuda):
            return None
        import torch

        streams = self._side_streams
        key = x.device.index if x.device.index is not None else torch.cuda.current_device()
        if key not in streams:
            streams[key] = torch.cuda.Stream(device=x.device)
        return streams[key]

    def _forward_chunked(self, xp: _Arrays, x, ids, topk_weights, packed, layout, weights, capacity: int,
                         chunks: int, tactic, out, mark):
        """Low-latency layer in `chunks` token chunks, pipelined. Issue order (every rank the same, so
        the exchanges pair up): D0; then for c: D(c+1), experts(c), combine K(c), finalize(c-1); then
        finalize of the last chunk. On the exchange stream that is D0 D1 K0 D2 K1 ... : D(c+1) runs
        while chunk c's experts compute, K(c-1) while chunk c computes; each finalize waits only for
        its own combine."""
        world, (num_tokens, top_k) = self.world_size, (int(ids.shape[0]), int(ids.shape[1]))
        per_chunk = chunk_capacity(capacity, chunks)
        bounds = chunk_bounds(num_tokens, chunks)
        if max(b - a for a, b in zip(bounds, bounds[1:])) > per_chunk:  # cannot happen once T <= capacity
            raise ValueError(f"qmoe: argument 'max_tokens_per_rank': expected every chunk to fit ceil("
                             f"{capacity} / {chunks}) = {per_chunk} rows, got chunk sizes {bounds}")
        w1, w1_scale, w2, w2_scale, w1_alpha, w2_alpha, fc2_input_scale = weights
        streams, keep = _Streams(xp, self._side_stream(x)), []
        base = xp.arange(world) * per_chunk
        plans = []
        for c in range(chunks):  # routing of every chunk: array ops on the compute stream, no host sync
            lo, hi = bounds[c], bounds[c + 1]
            routing = _Routing(xp, ids[lo:hi], self.num_experts, world)
            src = _send_index(xp, routing, base, world * per_chunk)  # chunk-local token, or hi - lo: pad
            rows_of = xp.where(src < hi - lo, src + lo, xp.full(src.shape, num_tokens))  # packed row (T: pad)
            plans.append((lo, hi, rows_of, routing.low_latency_row_index(xp, per_chunk)))

        def dispatch(c):
            send = packed[plans[c][2]]
            return self._exchange_async(xp, streams, keep, send, per_chunk, (packed.shape[1],), packed.dtype)

        expert_sms = self._expert_sm_limit(x)

        def experts(recv, done):
            streams.wait(done)
            received = self._unpack(xp, recv, layout)
            with limit_sms(expert_sms) if expert_sms else contextlib.nullcontext():
                return self._owner(received, w1, w1_scale, w2, w2_scale, w1_alpha, w2_alpha, fc2_input_scale, tactic)

        def combine(rows):
            return self._exchange_async(xp, streams, keep, rows, per_chunk * top_k, (rows.shape[1],), rows.dtype)

        def finalize(c, back, done):
            streams.wait(done)
            lo, hi, _, row_index = plans[c]
            if hi > lo:  # the chunk's rows of `out`: a contiguous view, written in place
                ops.moe_finalize(back, ids[lo:hi], topk_weights[lo:hi], num_experts=self.num_experts,
                                 routed_scaling_factor=self.routed_scaling_factor, output_dtype=self.output_dtype,
                                 out=out[lo:hi], row_index=row_index)

        mark("dispatch")
        dispatched, combined = {0: dispatch(0)}, {}
        for c in range(chunks):
            if c + 1 < chunks:
                dispatched[c + 1] = dispatch(c + 1)
            if c == 0:
                mark("compute")
            rows = experts(*dispatched.pop(c))
            if c == chunks - 1:
                mark("combine")
            combined[c] = combine(rows)
            if c >= 1:
                finalize(c - 1, *combined.pop(c - 1))
        mark("finalize")
        finalize(chunks - 1, *combined.pop(chunks - 1))
        streams.join()  # the compute stream waits for every exchange; `keep` is released after this
        mark("end")
        return out

    def _expert_sm_limit(self, x):
        """SMs for the experts' GEMMs of a chunked forward: all but comm_sms (and within the caller's own
        limit); None off the GPU or with comm_sms = 0 (then the caller's limit, if any, stays)."""
        if self.comm_sms == 0 or not (is_torch(x) and x.is_cuda):
            return None
        import torch

        total = torch.cuda.get_device_properties(x.device).multi_processor_count
        limit = max(1, total - self.comm_sms)
        outer = sm_limit()
        return min(limit, outer) if outer > 0 else limit

    def _exchange_async(self, xp: _Arrays, streams: _Streams, keep: list, buffer, rows_per_peer: int, row_shape,
                        dtype):
        """A fixed-size exchange (rows_per_peer rows to and from every peer) through `streams`;
        returns (receive buffer, completion handle). The receive buffer is allocated here, on the
        compute stream; both buffers stay in `keep` until the layer's join."""
        world = self.world_size
        sends = [buffer[d * rows_per_peer:(d + 1) * rows_per_peer] for d in range(world)]
        out = xp.empty((world * rows_per_peer,) + tuple(row_shape), dtype)
        keep.extend((buffer, out))
        done = streams.exchange(lambda: self.transport.all_to_all(sends, [rows_per_peer] * world, out=out))
        return out, done

    # ---- steps ----------------------------------------------------------------------------------

    def _quantize(self, x, x_scale, fc2_input_scale, per_token_scale, num_tokens) -> dict:
        """The per-token tensors that travel, quantized at home (w4a8_int4: e4m3 x and a1 per token)."""
        mode = self.quant_mode
        if mode != "w4a8_int4":
            parts = {"x": x, "x_scale": x_scale, "per_token_scale": per_token_scale}
            return {key: parts[key] for key in _PAYLOAD[mode] if parts[key] is not None}
        if fc2_input_scale is None:
            raise ValueError("qmoe: argument 'fc2_input_scale': expected a static a2 (f32 [1]) for expert "
                             "parallelism (the dynamic a2 is an amax over intermediate rows computed on other "
                             "ranks), got None")
        already_fp8 = str(getattr(x, "dtype", "")).endswith("float8_e4m3fn")
        if already_fp8:
            if x_scale is None:
                raise ValueError("qmoe: argument 'x_scale': expected the a1 of an e4m3 x (f32 [1] or [T]), got None")
            q, a1 = x, x_scale
        else:
            q, a1 = quant.quantize_fp8(x, x_scale)  # None: dynamic amax / 448 over this rank's x (no host sync)
        if is_torch(x) and not is_torch(q):  # torch CPU tensors: the quantizer answers in numpy
            q, a1 = _numpy_to_torch(q), _numpy_to_torch(np.asarray(a1, np.float32))
        a1 = a1.float().reshape(-1) if is_torch(a1) else np.asarray(a1, np.float32).reshape(-1)
        if a1.shape[0] not in (1, num_tokens):
            raise ValueError(f"qmoe: argument 'x_scale': expected shape [1] or [{num_tokens}], got {tuple(a1.shape)}")
        return {"x": q, "x_scale": a1}  # a [1] a1 is broadcast over the rows when packed

    def _pack(self, xp: _Arrays, payload: dict, num_tokens: int):
        """uint8 [T + 1, B]: each token's parts side by side, B a multiple of 16; row T is the pad row
        (zero bytes, topk_ids = -1). Returns it and the layout [(key, offset, bytes, dtype, row shape)]."""
        layout, offset = [], 0
        for key, tensor in payload.items():
            row_shape = tuple(tensor.shape[1:])
            nbytes = int(np.prod(row_shape, dtype=np.int64)) * _itemsize(tensor)
            layout.append((key, offset, nbytes, tensor.dtype, row_shape))
            offset += nbytes
        width = -(-offset // _ROW_ALIGN) * _ROW_ALIGN
        packed = xp.empty((num_tokens + 1, width), xp.uint8())
        for key, off, nbytes, _, _ in layout:
            tensor = payload[key]
            rows = tensor.shape[0]  # num_tokens, or 1 for a per-tensor a1 (broadcast)
            if num_tokens:
                packed[:num_tokens, off:off + nbytes] = xp.byte_rows(tensor, rows)
        packed[num_tokens] = 0
        _, ids_off, ids_bytes, _, _ = layout[-1]
        packed[num_tokens, ids_off:ids_off + ids_bytes] = 0xFF  # int32 -1
        if width > offset and num_tokens:
            packed[:num_tokens, offset:] = 0  # the alignment padding travels too: keep it defined
        return packed, layout

    def _unpack(self, xp: _Arrays, recv, layout) -> dict:
        return {key: xp.from_bytes(recv[:, off:off + nbytes], dtype, row_shape)
                for key, off, nbytes, dtype, row_shape in layout}

    def _exchange(self, xp: _Arrays, buffer, send_counts: list, recv_counts: list, row_shape, dtype):
        """Rows of `buffer` (grouped by destination, send_counts[d] each) to the peers; returns the
        received rows, grouped by source, as one contiguous array."""
        sends, start = [], 0
        for c in send_counts:
            sends.append(buffer[start:start + c])
            start += c
        out = xp.empty((sum(recv_counts),) + tuple(row_shape), dtype)
        self.transport.all_to_all(sends, recv_counts, out=out)
        return out

    def _exchange_counts(self, xp: _Arrays, routing: _Routing):
        """One small exchange of (tokens, owned slots) per peer; returns a callable that waits for the
        numbers on the host (the only host sync of the layer) and returns them as a dict of lists."""
        world = self.world_size
        mine = xp.contiguous(_stack_columns(xp, routing.send_counts, routing.return_counts))  # [W, 2]
        theirs = self._exchange(xp, mine, [1] * world, [1] * world, (2,), mine.dtype)
        later = xp.host_ints_later(_concat(xp, mine.reshape(-1), theirs.reshape(-1)))

        def wait():
            both = later()
            return {"send_tokens": both[0:2 * world:2], "send_slots": both[1:2 * world:2],
                    "recv_tokens": both[2 * world::2], "recv_slots": both[2 * world + 1::2]}

        return wait

    def _dispatch_throughput(self, xp: _Arrays, packed, send_src, counts: dict):
        """send_src: _send_index for a total of T*W; its first sum(send_tokens) entries are the send
        order (the positions are the same whatever the total, only the unused tail differs)."""
        total = sum(counts["send_tokens"])
        return self._exchange(xp, packed[send_src[:total]], counts["send_tokens"], counts["recv_tokens"],
                              (packed.shape[1],), packed.dtype)

    def _dispatch_low_latency(self, xp: _Arrays, packed, routing: _Routing, capacity: int):
        """Fixed [W, C] positions per peer; unused ones copy the pad row (topk_ids -1: skipped).
        Returns the received rows and the packed row (token, or T for the pad row) of each position."""
        world = self.world_size
        base = xp.arange(world) * capacity
        src = _send_index(xp, routing, base, world * capacity)
        return self._exchange(xp, packed[src], [capacity] * world, [capacity] * world, (packed.shape[1],),
                              packed.dtype), src

    def _owner(self, recv, w1, w1_scale, w2, w2_scale, w1_alpha, w2_alpha, fc2_input_scale, tactic, reduce=False):
        """The owner's engine over the received tokens with its local experts: one bf16 row per owned slot
        (moe_expert_rows), or with the reduced combine one partial row per token in the output dtype
        (fused_moe with its own finalize; zero where it owns no slot of the token)."""
        ids = recv["topk_ids"]
        if ids.shape[0] == 0:  # this rank received no token
            dtype = ops._dtype_name(self.output_dtype) if reduce else "bfloat16"
            return ops.empty_like_framework(ids, (0, w2.shape[1]), dtype)
        common = dict(quant_mode=self.quant_mode, num_experts=self.num_experts, x_scale=recv.get("x_scale"),
                      per_token_scale=recv.get("per_token_scale"), w1_alpha=w1_alpha, w2_alpha=w2_alpha,
                      fc2_input_scale=fc2_input_scale, num_local_experts=self.experts_per_rank,
                      local_expert_offset=self.local_expert_offset, tactic=tactic,
                      fp4_weights_packed=self.fp4_weights_packed, **self.options)
        if reduce:
            return ops.fused_moe(recv["x"], ids, recv["topk_weights"], w1, w1_scale, w2, w2_scale, deterministic=False,
                                 routed_scaling_factor=self.routed_scaling_factor, output_dtype=self.output_dtype,
                                 **common)
        return ops.moe_expert_rows(recv["x"], ids, w1, w1_scale, w2, w2_scale, **common)

    def _low_latency_cpp(self, x, ids, topk_weights, w1, w1_scale, w2, w2_scale, x_scale, fc2_input_scale, w1_alpha,
                         w2_alpha, per_token_scale, capacity, out, tactic, deterministic):
        """The unchunked low-latency layer through the C++ layer on the transport's communicator (CUDA)."""
        from ._tensors import current_stream

        if out is None:
            out = ops.empty_like_framework(x, (int(ids.shape[0]), int(w2.shape[1])), ops._dtype_name(self.output_dtype))
        o = dict(swiglu_alpha=1.0, swiglu_beta=0.0, swiglu_limit=float("inf"), situ_beta=1.0, situ_linear_beta=None)
        o.update({k: v for k, v in self.options.items() if k in o})
        call = ops._layer_call(self.quant_mode, x, x_scale, ids, topk_weights, w1, w1_scale, w1_alpha, fc2_input_scale,
                               w2, w2_scale, w2_alpha, per_token_scale, (out, "out"), self.num_experts,
                               self.experts_per_rank, self.local_expert_offset, self.options["activation"],
                               o["swiglu_alpha"], o["swiglu_beta"], o["swiglu_limit"], o["situ_beta"],
                               o["situ_linear_beta"], self.options["gate_up_layout"], bool(deterministic),
                               self.routed_scaling_factor, tactic)
        call.fp4_weights_packed = self.fp4_weights_packed
        nbytes = _C.ep_low_latency_layer_workspace_size(call, self.world_size, self.rank, capacity)
        workspace = _empty_bytes(x, nbytes)
        _C.ep_low_latency_layer(call, self.world_size, self.rank, capacity, self.transport.comm,
                                ops.arg(workspace, "workspace"), current_stream(out))
        return out

    def _sum_partials(self, xp: _Arrays, back, token_of_row, groups: list, num_tokens: int, out):
        """Reduced combine, home: back row i is the partial of packed row token_of_row[i] (T: the pad row)
        from the rank whose group (groups[d] rows, in rank order) holds i; out[t] = the fp32 sum of its
        partials in rank order, rounded once to the output dtype. One scatter-add per rank: a token
        appears at most once in a rank's group, so each add is order-free (the pad row T collects the
        unused positions and is dropped)."""
        hidden = back.shape[1]
        name = ops._dtype_name(self.output_dtype)
        if xp.torch:
            torch = xp.torch
            acc = torch.zeros((num_tokens + 1, hidden), dtype=torch.float32, device=back.device)
            start = 0
            for c in groups:
                acc.index_add_(0, token_of_row[start:start + c].long(), back[start:start + c].float())
                start += c
            result = acc[:num_tokens].to(getattr(torch, name))
            return result if out is None else out.copy_(result)
        acc = np.zeros((num_tokens + 1, hidden), np.float32)
        start = 0
        for c in groups:
            acc[np.asarray(token_of_row[start:start + c], np.int64)] += np.asarray(back[start:start + c], np.float32)
            start += c
        result = acc[:num_tokens].astype(ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name))
        if out is None:
            return result
        out[...] = result
        return out

    def _combine_throughput(self, xp: _Arrays, rows, recv_ids, counts):
        """Owner: rows of its slots, grouped by source rank in receive order ((token, slot) order).
        Home: the receive buffer as it arrived; the row of its slot s owned by d is at
        return_offset[d] + (rank of s among d's slots) (_Routing.throughput_row_index)."""
        hidden = rows.shape[1]
        owned_total = sum(counts["recv_slots"])
        ids64 = xp.int64(recv_ids).reshape(-1)
        lo = self.local_expert_offset
        owned = (ids64 >= lo) & (ids64 < lo + self.experts_per_rank)  # valid and local, flat [N*k]
        slot_rank = xp.cumsum0(xp.int64(owned)) - 1
        target = xp.where(owned, slot_rank, xp.full(slot_rank.shape, owned_total))
        ret_src = xp.full((owned_total + 1,), 0)
        ret_src[target] = xp.arange(int(ids64.shape[0]))
        return self._exchange(xp, rows[ret_src[:owned_total]], counts["recv_slots"], counts["send_slots"],
                              (hidden,), rows.dtype)

    def _combine_low_latency(self, xp: _Arrays, rows, capacity: int):
        """Owner: its whole [W, C*k, H] row buffer back (fixed size). Home: the buffer as it arrived;
        row of (t, j) owned by d sits at d*C*k + position(t in d's list)*k + j
        (_Routing.low_latency_row_index)."""
        world, hidden = self.world_size, rows.shape[1]
        chunk = rows.shape[0] // world  # C*k: the owner's rows are [W*C, k] flat
        return self._exchange(xp, rows, [chunk] * world, [chunk] * world, (hidden,), rows.dtype)


def _empty_bytes(like, nbytes: int):
    """An uninitialised uint8 buffer of nbytes on like's device (torch)."""
    import torch

    return torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device=like.device)


def _numpy_to_torch(a):
    from . import testing

    return testing.to_torch(np.asarray(a), "cpu")


def _itemsize(t) -> int:
    return t.element_size() if is_torch(t) else t.dtype.itemsize


def _stack_columns(xp: _Arrays, a, b):
    if xp.torch:
        return xp.torch.stack([xp.int64(a), xp.int64(b)], 1)
    return np.stack([xp.int64(a), xp.int64(b)], 1)


def _concat(xp: _Arrays, a, b):
    return xp.torch.cat([a, b]) if xp.torch else np.concatenate([a, b])

