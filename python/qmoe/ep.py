"""Expert parallelism (docs/expert-parallel.md): one MoE layer over W ranks, each holding E / W experts.

Every rank brings its own tokens x [T, H] with their routing (topk_ids, topk_weights [T, k]) and gets
back the full MoE output of those tokens:

    plan (include/qmoe/expert_parallel.h) -> quantize at home -> dispatch -> moe_expert_rows on the
    owner (its local experts only) -> combine (one bf16 row per owned slot back home) -> moe_finalize

Exactness: rows are formed per slot from the same numbers as on one GPU (the activation row and its
a1 travel together; a2 is static), and the home rank runs the deterministic finalize in slot order,
so EP output == qmoe.fused_moe(all experts, deterministic=True) on the rank's tokens, bit for bit.

Scale rule for w4a8_int4 (the only mode with tensor-wide dynamic scales): a1 may be static ([1]),
per token ([T]) or dynamic (None: amax over the HOME rank's x / 448, as fused_moe computes it on
that rank's tokens); the home rank quantizes and a1 travels per token. a2 (fc2_input_scale) must be
given: the dynamic a2 is the amax over the intermediate rows of all of a rank's tokens, which are
computed on several ranks, and agreeing on it would need an extra all-reduce between GEMM1 and GEMM2.

Modes: "throughput" exchanges per-peer token counts first (one host sync), then variable-size
buffers. "low_latency" uses fixed buffers of max_tokens_per_rank rows per peer, no count exchange and
no data-dependent size (CUDA-graph capturable once the GPU pieces exist); T > max_tokens_per_rank is an
error, never a silent drop. CPU (numpy) arrays run the C++ reference engine; the GPU moe_expert_rows /
moe_finalize and a device-side plan are not built yet (see the doc's "what remains").
"""
from __future__ import annotations

import numpy as np

from . import _C, ops, quant
from ._tensors import arg, is_torch

try:
    import ml_dtypes
except ImportError:  # pragma: no cover
    ml_dtypes = None

MODES = ("throughput", "low_latency")
# The per-token payload of each quant mode, in wire order (topk_ids is appended to every mode).
_PAYLOAD = {
    "w4a8_int4": ("x", "x_scale"),
    "w4a16_int4": ("x",),
    "w4a16": ("x",),
    "w4a8": ("x", "x_scale"),
    "w4a4": ("x", "x_scale", "per_token_scale"),
}


# ---- array helpers (numpy now; torch where it is the same one-liner) -----------------------------

def _host_i32(a) -> np.ndarray:
    if is_torch(a):
        a = a.detach().cpu().numpy()  # the plan runs on the host (throughput mode syncs anyway)
    return np.ascontiguousarray(np.asarray(a), dtype=np.int32)


def _take(a, index: np.ndarray):
    if is_torch(a):
        import torch

        return a[torch.as_tensor(index, dtype=torch.int64, device=a.device)]
    return a[index]


def _cat(parts: list, like):
    if is_torch(like):
        import torch

        return torch.cat(parts)
    return np.concatenate(parts)


def _full(like, shape, value):
    if is_torch(like):
        import torch

        return torch.full(shape, value, dtype=like.dtype, device=like.device)
    return np.full(shape, value, dtype=like.dtype)


class ExpertParallelMoE:
    """One MoE layer with experts split evenly over world_size ranks; this object is one rank."""

    def __init__(self, world_size: int, rank: int, num_experts: int, *, transport, quant_mode: str = "w4a8_int4",
                 activation: str = "swiglu", gate_up_layout: str = "gate_up", routed_scaling_factor: float = 1.0,
                 output_dtype: str = "bfloat16", **activation_options):
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
        self.routed_scaling_factor, self.output_dtype = float(routed_scaling_factor), output_dtype

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
                max_tokens_per_rank=None, out=None):
        """out [T, H] for this rank's tokens. w1 / w2 / scales / alphas: this rank's E / W experts."""
        if mode not in MODES:
            raise ValueError(f"qmoe: argument 'mode': expected one of {MODES}, got {mode!r}")
        if len(getattr(topk_ids, "shape", ())) != 2:
            raise ValueError(f"qmoe: argument 'topk_ids': expected [T, k], got shape {getattr(topk_ids, 'shape', ())}")
        num_tokens, top_k = topk_ids.shape
        if mode == "low_latency":
            if max_tokens_per_rank is None:
                raise ValueError("qmoe: argument 'max_tokens_per_rank': expected the fixed per-peer capacity of "
                                 "the low-latency mode, got None")
            _C.ep_check_low_latency_capacity(num_tokens, int(max_tokens_per_rank))  # before any exchange
        elif max_tokens_per_rank is not None:
            raise ValueError("qmoe: argument 'max_tokens_per_rank': expected None in mode 'throughput' (it sizes the "
                             f"low-latency buffers), got {max_tokens_per_rank}")
        payload = self._quantize(x, x_scale, fc2_input_scale, per_token_scale, num_tokens)
        ids_host = _host_i32(topk_ids)
        plan = {key: np.asarray(v, np.int64) for key, v in
                _C.ep_plan(arg(ids_host, "topk_ids"), self.num_experts, self.world_size).items()}
        payload["topk_ids"] = topk_ids if is_torch(topk_ids) else ids_host

        if mode == "throughput":
            recv, recv_counts = self._dispatch_throughput(payload, plan)
        else:
            recv, recv_counts = self._dispatch_low_latency(payload, plan, int(max_tokens_per_rank))
        rows = self._expert_rows(recv, w1, w1_scale, w2, w2_scale, w1_alpha, w2_alpha, fc2_input_scale,
                                 zero_fill=mode == "low_latency")
        if mode == "throughput":
            home_rows = self._combine_throughput(rows, recv["topk_ids"], recv_counts, plan, num_tokens, top_k)
        else:
            home_rows = self._combine_low_latency(rows, plan, num_tokens, top_k, int(max_tokens_per_rank))
        return ops.moe_finalize(home_rows, payload["topk_ids"], topk_weights, num_experts=self.num_experts,
                                routed_scaling_factor=self.routed_scaling_factor, output_dtype=self.output_dtype,
                                out=out)

    __call__ = forward

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
            q, a1 = quant.quantize_fp8(x, x_scale)  # None: dynamic amax / 448 over this rank's x
        a1 = np.asarray(a1, np.float32).reshape(-1) if not is_torch(a1) else a1.float().reshape(-1)
        if a1.shape[0] not in (1, num_tokens):
            raise ValueError(f"qmoe: argument 'x_scale': expected shape [1] or [{num_tokens}], got {tuple(a1.shape)}")
        if a1.shape[0] == 1:
            a1 = _full(a1, (num_tokens,), float(a1[0]))
        return {"x": q, "x_scale": a1}

    def _dispatch_throughput(self, payload: dict, plan: dict):
        send_counts, off = plan["send_counts"], plan["send_offsets"]
        recv_counts = self.transport.all_to_all_counts(send_counts.tolist())
        recv = {}
        for key, tensor in payload.items():
            sends = [_take(tensor, plan["send_tokens"][off[d]:off[d + 1]]) for d in range(self.world_size)]
            recv[key] = _cat(self.transport.all_to_all(sends, recv_counts), tensor)
        return recv, recv_counts

    def _dispatch_low_latency(self, payload: dict, plan: dict, capacity: int):
        """Fixed [W, C, ...] buffers; unused positions get topk_ids -1 (skipped by the engine), a1 = 1."""
        off, world = plan["send_offsets"], self.world_size
        recv = {}
        for key, tensor in payload.items():
            fill = -1 if key == "topk_ids" else (1 if key in ("x_scale", "per_token_scale") else 0)
            sends = []
            for d in range(world):
                buf = _full(tensor, (capacity,) + tuple(tensor.shape[1:]), fill)
                n = int(off[d + 1] - off[d])
                buf[:n] = _take(tensor, plan["send_tokens"][off[d]:off[d + 1]])
                sends.append(buf)
            recv[key] = _cat(self.transport.all_to_all(sends, [capacity] * world), tensor)
        return recv, [capacity] * world

    def _expert_rows(self, recv, w1, w1_scale, w2, w2_scale, w1_alpha, w2_alpha, fc2_input_scale, zero_fill):
        ids = recv["topk_ids"]
        num, top_k, hidden = ids.shape[0], ids.shape[1], w2.shape[1]
        if num == 0:  # this rank received no token
            return np.zeros((0, hidden), ml_dtypes.bfloat16)
        rows = np.zeros((num * top_k, hidden), ml_dtypes.bfloat16) if zero_fill and not is_torch(ids) else None
        return ops.moe_expert_rows(
            recv["x"], ids, w1, w1_scale, w2, w2_scale, quant_mode=self.quant_mode, num_experts=self.num_experts,
            x_scale=recv.get("x_scale"), per_token_scale=recv.get("per_token_scale"), w1_alpha=w1_alpha,
            w2_alpha=w2_alpha, fc2_input_scale=fc2_input_scale, num_local_experts=self.experts_per_rank,
            local_expert_offset=self.local_expert_offset, rows=rows, **self.options)

    def _combine_throughput(self, rows, recv_ids, recv_counts, plan, num_tokens, top_k):
        """Owner: rows of its slots, grouped by source rank in receive order. Home: place them by plan."""
        world = self.world_size
        slots = np.zeros(0, np.int64)
        if recv_ids.shape[0]:
            slots = np.asarray(_C.ep_owner_return_slots(arg(_host_i32(recv_ids), "recv_ids"), self.num_experts,
                                                        world, self.rank), np.int64)
        token_bounds = np.cumsum([0] + list(recv_counts)) * top_k  # slot bounds of each source's tokens
        cut = np.searchsorted(slots, token_bounds)
        sends = [_take(rows, slots[cut[s]:cut[s + 1]]) for s in range(world)]
        back = self.transport.all_to_all(sends, plan["return_counts"].tolist())
        home = _full(rows, (num_tokens * top_k, rows.shape[1]), 0)
        home[plan["return_slots"]] = _cat(back, rows)
        return home

    def _combine_low_latency(self, rows, plan, num_tokens, top_k, capacity):
        """Owner: its whole [W, C*k, H] row buffer back (fixed size). Home: row of (t, j) from owner d
        sits at position(t in d's list) * k + j."""
        world, hidden = self.world_size, rows.shape[1]
        chunk = capacity * top_k
        sends = [rows[s * chunk:(s + 1) * chunk] for s in range(world)]
        back = self.transport.all_to_all(sends, [chunk] * world)
        home = _full(rows, (num_tokens * top_k, hidden), 0)
        off, roff = plan["send_offsets"], plan["return_offsets"]
        for d in range(world):
            position = np.full(num_tokens, -1, np.int64)
            position[plan["send_tokens"][off[d]:off[d + 1]]] = np.arange(off[d + 1] - off[d])
            slots = plan["return_slots"][roff[d]:roff[d + 1]]
            home[slots] = _take(back[d], position[slots // top_k] * top_k + slots % top_k)
        return home
