"""Transports of expert parallelism (docs/expert-parallel.md): how per-peer buffers move between ranks.

A transport exposes world_size, rank and two collective calls that every rank makes in the same order:
  all_to_all_counts(counts) -> counts   counts[d] ints sent to rank d; returns what each rank sent here
  all_to_all(sends, recv_counts, out=None) -> recvs
      sends[d]: array [n_d, ...] for rank d (all with the same dtype and row shape);
      recvs[s]: array [recv_counts[s], ...] from rank s, same dtype and row shape;
      out: optional contiguous array [>= sum(recv_counts), ...]; recvs are then its consecutive
      slices (grouped by source, no extra copy on the NCCL transport).

LoopbackGroup simulates W ranks in one process (one thread per rank, numpy arrays or torch CPU
tensors), for tests on a CPU; it checks that the sizes both sides agree on are equal, which NCCL
cannot (it would hang or corrupt). NcclTransport runs the C++ dlopen'ed NCCL transport (grouped ncclSend/ncclRecv) on torch
CUDA tensors and torch's current stream.
"""
from __future__ import annotations

import os
import threading

import numpy as np

from . import _C
from ._tensors import arg, current_stream, is_torch


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

    def all_to_all(self, sends: list, recv_counts: list, out=None) -> list:
        if len(sends) != self.world_size or len(recv_counts) != self.world_size:
            raise ValueError(f"qmoe: argument 'sends': expected {self.world_size} per-peer buffers, got {len(sends)}")
        got = self.group.exchange(self.rank, [_wire_copy(s) for s in sends])
        for src, (buf, want) in enumerate(zip(got, recv_counts)):
            if buf.shape[0] != want:
                raise RuntimeError(f"qmoe: loopback: rank {self.rank} expected {want} rows from rank {src}, "
                                   f"which sent {buf.shape[0]} (the plan of the two sides disagrees)")
        if out is None:
            return got
        views, start = [], 0
        for buf in got:
            if buf.shape[1:] != out.shape[1:] or buf.dtype != out.dtype:
                raise RuntimeError(f"qmoe: loopback: rank {self.rank} got rows {buf.dtype} {buf.shape[1:]} for an "
                                   f"output of {out.dtype} {out.shape[1:]}")
            out[start:start + buf.shape[0]] = buf
            views.append(out[start:start + buf.shape[0]])
            start += buf.shape[0]
        return views


def _wire_copy(buffer):
    """What the receiver gets: a copy (numpy arrays or torch CPU tensors, kept in their framework)."""
    return buffer.clone() if is_torch(buffer) else np.array(buffer, copy=True)


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

    def all_to_all(self, sends: list, recv_counts: list, out=None) -> list:
        """Grouped ncclSend/ncclRecv on torch's current stream of the buffers' device (the chunked EP
        forward makes its exchange stream current around this call, see ep._Streams): asynchronous,
        no host sync, capturable in a CUDA graph (after one eager call has set up NCCL's peer
        connections). Zero-row buffers are skipped. Both sides must agree on every size (NCCL cannot
        check: a mismatch hangs or corrupts)."""
        import torch

        if self.comm == 0:
            raise RuntimeError("qmoe: argument 'transport': expected an open NCCL communicator, got a closed one")
        if len(sends) != self.world_size or len(recv_counts) != self.world_size:
            raise ValueError(f"qmoe: argument 'sends': expected {self.world_size} per-peer buffers, got {len(sends)}")
        row, dtype, dev = tuple(sends[self.rank].shape[1:]), sends[self.rank].dtype, sends[self.rank].device
        for peer, s in enumerate(sends):
            if not (is_torch(s) and s.is_cuda) or tuple(s.shape[1:]) != row or s.dtype != dtype or s.device != dev:
                raise ValueError(f"qmoe: argument 'sends': expected CUDA tensors [n, {row}] {dtype} on {dev} for "
                                 f"every peer, got {type(s).__name__} {getattr(s, 'dtype', '')} "
                                 f"{tuple(getattr(s, 'shape', ()))} for peer {peer}")
        sends = [s.contiguous() for s in sends]
        if out is None:
            recvs = [torch.empty((int(c),) + row, dtype=dtype, device=dev) for c in recv_counts]
        else:
            total = sum(int(c) for c in recv_counts)
            if (not out.is_contiguous() or out.shape[0] < total or tuple(out.shape[1:]) != row or out.dtype != dtype
                    or out.device != dev):
                raise ValueError(f"qmoe: argument 'out': expected a contiguous [>= {total}, {row}] {dtype} tensor on "
                                 f"{dev}, got {out.dtype} {tuple(out.shape)} on {out.device}")
            recvs, start = [], 0
            for c in recv_counts:
                recvs.append(out[start:start + int(c)])
                start += int(c)
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


class ProcessGroupTransport:
    """all_to_all over torch.distributed point-to-point calls (isend / irecv of byte views) on any
    backend: gloo with CPU tensors (multi-process CPU tests of the EP layer), or torch's own NCCL
    group. Blocking (each call waits for its transfers): a reference and fallback, not the fast path."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self.group = group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def all_to_all_counts(self, counts) -> list:
        import torch

        sends = [torch.tensor([int(c)], dtype=torch.int64) for c in counts]
        return [int(r[0]) for r in self.all_to_all(sends, [1] * self.world_size)]

    def all_to_all(self, sends: list, recv_counts: list, out=None) -> list:
        import torch
        import torch.distributed as dist

        if len(sends) != self.world_size or len(recv_counts) != self.world_size:
            raise ValueError(f"qmoe: argument 'sends': expected {self.world_size} per-peer buffers, got {len(sends)}")
        row, dtype, dev = tuple(sends[self.rank].shape[1:]), sends[self.rank].dtype, sends[self.rank].device
        if out is None:
            out = torch.empty((sum(int(c) for c in recv_counts),) + row, dtype=dtype, device=dev)
        recvs, start = [], 0
        for c in recv_counts:
            recvs.append(out[start:start + int(c)])
            start += int(c)
        pending = []
        for peer in range(self.world_size):
            send, recv = sends[peer].contiguous(), recvs[peer]
            if peer == self.rank:
                recv.copy_(send)
                continue
            global_peer = dist.get_global_rank(self.group, peer) if self.group is not None else peer
            if send.numel():
                pending.append(dist.isend(_bytes_view(send), global_peer, group=self.group))
            if recv.numel():
                pending.append(dist.irecv(_bytes_view(recv), global_peer, group=self.group))
        for work in pending:
            work.wait()
        return recvs


# ------------------------------------------------------------------------------------------------
# Local launcher (tests, benchmarks): one process per GPU of this host, no network
# ------------------------------------------------------------------------------------------------

def _spawned(rank: int, fn, world_size: int, store_path: str, timeout_s: float, args: tuple):
    """Body of one spawned process: environment, device, torch.distributed (gloo, FileStore), fn."""
    import datetime
    import sys

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pairs stay on the loopback interface
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        rc = fn(rank, world_size, *args)
    finally:
        sys.stdout.flush()
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at exit
        pass
    if rc:
        sys.exit(int(rc))


def spawn_local(fn, world_size: int = 2, args: tuple = (), timeout_s: float = 540.0,
                collective_timeout_s: float = 180.0) -> int:
    """Run fn(rank, world_size, *args) in world_size processes of this host, rank r on cuda:r, each
    with torch.distributed initialized (gloo through a FileStore: no TCP rendezvous, no port) and
    NCCL_NVLS_ENABLE=0 unless already set. fn is a module-level function returning 0 (success) or an
    exit code. Returns 0 when every process exited with 0, else 1; after timeout_s the processes
    still running are terminated (a rank stuck in an NCCL call whose peer failed never returns)."""
    import tempfile
    import time

    import torch.multiprocessing as mp

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = tempfile.NamedTemporaryFile(prefix="qmoe_ep_store_", delete=False)
    store.close()
    os.unlink(store.name)  # the FileStore creates it; a stale file would hold old keys
    context = mp.spawn(_spawned, args=(fn, world_size, store.name, collective_timeout_s, tuple(args)),
                       nprocs=world_size, join=False)
    deadline = time.monotonic() + timeout_s
    status = 0
    try:
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                print(f"qmoe spawn_local: TIMEOUT after {timeout_s:.0f} s: terminating the ranks still running "
                      "(one is probably waiting in NCCL for a peer that failed; see the lines above)", flush=True)
                for proc in context.processes:
                    if proc.is_alive():
                        proc.terminate()
                status = 1
                break
    except Exception as e:  # noqa: BLE001 - a rank raised or exited non-zero: report, terminate the rest
        print(f"qmoe spawn_local: a rank failed: {type(e).__name__}: {e}", flush=True)
        for proc in context.processes:
            if proc.is_alive():
                proc.terminate()
        status = 1
    finally:
        if os.path.exists(store.name):
            os.unlink(store.name)
    return status
