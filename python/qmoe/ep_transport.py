"""Transports of expert parallelism (docs/expert-parallel.md): how per-peer buffers move between ranks.

A transport exposes world_size, rank and two collective calls that every rank makes in the same order:
  all_to_all_counts(counts) -> counts   counts[d] ints sent to rank d; returns what each rank sent here
  all_to_all(sends, recv_counts) -> recvs
      sends[d]: array [n_d, ...] for rank d (all with the same dtype and row shape);
      recvs[s]: array [recv_counts[s], ...] from rank s, same dtype and row shape.

LoopbackGroup simulates W ranks in one process (one thread per rank, numpy arrays), for tests on a
CPU; it checks that the sizes both sides agree on are equal, which NCCL cannot (it would hang or
corrupt). NcclTransport runs the C++ dlopen'ed NCCL transport (grouped ncclSend/ncclRecv) on torch
CUDA tensors and torch's current stream.
"""
from __future__ import annotations

import os
import threading

import numpy as np

from . import _C
from ._tensors import arg, current_stream


class LoopbackGroup:
    """W simulated ranks sharing a mailbox; transport(rank) is the view of one rank."""

    def __init__(self, world_size: int, timeout_s: float = 60.0):
        if int(world_size) < 1:
            raise ValueError(f"qmoe: argument 'world_size': expected a value >= 1, got {world_size}")
        self.world_size = int(world_size)
        self._barrier = threading.Barrier(self.world_size, timeout=timeout_s)
        self._mailbox = [None] * self.world_size
        self.calls = 0  # exchanges so far (rank 0 counts), for tests

    def transport(self, rank: int) -> "LoopbackTransport":
        return LoopbackTransport(self, rank)

    def exchange(self, rank: int, sends: list) -> list:
        self._mailbox[rank] = sends
        self._barrier.wait()
        got = [self._mailbox[src][rank] for src in range(self.world_size)]
        if rank == 0:
            self.calls += 1
        self._barrier.wait()  # nobody overwrites the mailbox before every rank has read it
        return got

    def abort(self):
        self._barrier.abort()


class LoopbackTransport:
    def __init__(self, group: LoopbackGroup, rank: int):
        if not 0 <= int(rank) < group.world_size:
            raise ValueError(f"qmoe: argument 'rank': expected a value in [0, {group.world_size}), got {rank}")
        self.group, self.world_size, self.rank = group, group.world_size, int(rank)

    def all_to_all_counts(self, counts) -> list:
        return [int(c) for c in self.group.exchange(self.rank, [int(c) for c in counts])]

    def all_to_all(self, sends: list, recv_counts: list) -> list:
        if len(sends) != self.world_size or len(recv_counts) != self.world_size:
            raise ValueError(f"qmoe: argument 'sends': expected {self.world_size} per-peer buffers, got {len(sends)}")
        got = self.group.exchange(self.rank, [np.array(s, copy=True) for s in sends])  # the wire copies
        for src, (buf, want) in enumerate(zip(got, recv_counts)):
            if buf.shape[0] != want:
                raise RuntimeError(f"qmoe: loopback: rank {self.rank} expected {want} rows from rank {src}, "
                                   f"which sent {buf.shape[0]} (the plan of the two sides disagrees)")
        return got


def run_loopback(world_size: int, fn, timeout_s: float = 60.0, group: LoopbackGroup | None = None) -> list:
    """Run fn(rank, transport) on world_size threads over one LoopbackGroup (a new one unless given);
    returns the results in rank order. The first error of any rank is raised here (the other ranks are
    released, not hung)."""
    group = LoopbackGroup(world_size, timeout_s) if group is None else group
    results, errors = [None] * world_size, [None] * world_size

    def body(rank):
        try:
            results[rank] = fn(rank, group.transport(rank))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors[rank] = e
            group.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    primary = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if primary or any(errors):
        raise (primary or [e for e in errors if e is not None])[0]
    return results


# ------------------------------------------------------------------------------------------------
# NCCL
# ------------------------------------------------------------------------------------------------

def _tell_nccl_wheel_dir():
    """Let the C++ loader fall back to the nvidia-nccl wheel's lib directory, if that wheel is there."""
    try:
        import nvidia.nccl as wheel  # noqa: PLC0415 - optional
    except ImportError:
        return
    for base in list(getattr(wheel, "__path__", [])):
        lib = os.path.join(base, "lib")
        if os.path.exists(os.path.join(lib, "libnccl.so.2")):
            _C.nccl_set_search_dir(lib)
            return


def nccl_available() -> bool:
    """True when libnccl loads (QMOE_NCCL_LIBRARY, the loader's search path, or the nvidia-nccl wheel)."""
    _tell_nccl_wheel_dir()
    return bool(_C.nccl_available())


class NcclTransport:
    """Grouped ncclSend/ncclRecv on a communicator qmoe creates (or the caller's, as an int pointer)."""

    def __init__(self, comm: int, world_size: int, rank: int, device=None, owns_comm: bool = False):
        self.comm, self.world_size, self.rank = int(comm), int(world_size), int(rank)
        self.device, self._owns = device, owns_comm

    @classmethod
    def from_unique_id(cls, unique_id: bytes, world_size: int, rank: int, device=None) -> "NcclTransport":
        _tell_nccl_wheel_dir()
        if device is not None:
            import torch

            torch.cuda.set_device(device)  # ncclCommInitRank binds the current device
        return cls(_C.nccl_comm_init_rank(int(world_size), bytes(unique_id), int(rank)), world_size, rank, device,
                   owns_comm=True)

    @classmethod
    def from_process_group(cls, group=None, device=None) -> "NcclTransport":
        """Rank 0 of `group` makes an NCCL unique id; the group broadcasts it; every rank joins."""
        import torch
        import torch.distributed as dist

        _tell_nccl_wheel_dir()
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        box = [_C.nccl_get_unique_id() if rank == 0 else None]
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(box, src=src, group=group)
        device = device if device is not None else torch.cuda.current_device()
        return cls.from_unique_id(box[0], world, rank, device)

    def all_to_all_counts(self, counts) -> list:
        import torch

        dev = self.device if self.device is not None else torch.cuda.current_device()
        sends = [torch.tensor([int(c)], dtype=torch.int64, device=dev) for c in counts]
        recvs = self.all_to_all(sends, [1] * self.world_size)
        return [int(v) for v in torch.cat(recvs).cpu().tolist()]  # host sync: throughput mode only

    def all_to_all(self, sends: list, recv_counts: list) -> list:
        import torch

        if len(sends) != self.world_size or len(recv_counts) != self.world_size:
            raise ValueError(f"qmoe: argument 'sends': expected {self.world_size} per-peer buffers, got {len(sends)}")
        row, dtype, dev = tuple(sends[self.rank].shape[1:]), sends[self.rank].dtype, sends[self.rank].device
        sends = [s.contiguous() for s in sends]
        recvs = [torch.empty((int(c),) + row, dtype=dtype, device=dev) for c in recv_counts]
        _C.nccl_all_to_all_v(self.comm, [arg(_bytes_view(s), "sends") for s in sends],
                             [arg(_bytes_view(r), "recvs") for r in recvs], current_stream(sends[self.rank]))
        return recvs

    def close(self):
        if self._owns and self.comm:
            _C.nccl_comm_destroy(self.comm)
        self.comm = 0


def _bytes_view(t):
    """A uint8 view of a contiguous torch tensor (NCCL moves bytes; any dtype, fp8 included)."""
    import torch

    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)
