"""Transports for :class:`gradwire.AllReduce`: the raw collectives of byte buffers that the
library's protocol runs on (its length exchange, collective size limits and checks are added in
Rust, so every transport follows the same rules).

A transport is any object with ``rank`` and ``world_size`` and two methods, called by every rank
in the same order:

- ``all_gather(data: bytes, lengths: list[int]) -> list[bytes]``: every rank's buffer in rank
  order; ``lengths[i]`` is rank ``i``'s length, known to every rank before the call;
- ``all_to_all(send: list[bytes], recv_lengths: list[int]) -> list[bytes]``: ``send[j]`` goes to
  rank ``j``; returns what each rank sent here (``recv_lengths[i]`` bytes from rank ``i``).

The deadline is the transport's own: a call that raises (on a timeout or otherwise) fails that
rank's step with a :class:`gradwire.GradwireError` carrying its message. Nothing here unpickles
what peers send: buffers travel as raw bytes.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence


class TorchDistributed:
    """The raw collectives over ``torch.distributed`` (gloo on CPU; any backend with
    ``all_gather`` and ``all_to_all_single`` of uint8 tensors). Uneven buffers are padded to
    the longest (gloo refuses uneven all-gathers); their lengths are known beforehand, so
    nothing else is exchanged.

    ``group``: the process group (default: the world). The deadline is the group's timeout
    (``init_process_group(..., timeout=...)``; 30 minutes by default for gloo): set it to what
    a step may take.
    """

    def __init__(self, group: Optional[Any] = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
        self._dist = dist
        self.group = group
        self.rank: int = dist.get_rank(group)
        self.world_size: int = dist.get_world_size(group)

    def all_gather(self, data: bytes, lengths: Sequence[int]) -> List[bytes]:
        import torch

        longest = max(lengths) if lengths else 0
        mine = torch.zeros(longest, dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        outs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        self._dist.all_gather(outs, mine, group=self.group)
        return [o[:n].numpy().tobytes() for o, n in zip(outs, lengths)]

    def all_to_all(self, send: Sequence[bytes], recv_lengths: Sequence[int]) -> List[bytes]:
        import torch

        packed = b"".join(send)
        inp = torch.frombuffer(bytearray(packed), dtype=torch.uint8) if packed else torch.empty(0, dtype=torch.uint8)
        out = torch.empty(sum(recv_lengths), dtype=torch.uint8)
        self._dist.all_to_all_single(
            out,
            inp,
            output_split_sizes=list(recv_lengths),
            input_split_sizes=[len(b) for b in send],
            group=self.group,
        )
        flat = out.numpy().tobytes()
        result, at = [], 0
        for n in recv_lengths:
            result.append(flat[at : at + n])
            at += n
        return result


class Mpi4py:
    """The raw collectives over an ``mpi4py`` communicator (``MPI.COMM_WORLD`` by default), with
    ``Allgatherv`` and ``Alltoallv`` of bytes (never the pickling lower-case calls). The
    deadline is MPI's: a lost peer ends the job."""

    def __init__(self, comm: Optional[Any] = None) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank: int = self.comm.Get_rank()
        self.world_size: int = self.comm.Get_size()

    def all_gather(self, data: bytes, lengths: Sequence[int]) -> List[bytes]:
        import numpy as np

        counts = [int(n) for n in lengths]
        displs = [sum(counts[:i]) for i in range(len(counts))]
        recv = np.empty(sum(counts), dtype=np.uint8)
        send = np.frombuffer(data, dtype=np.uint8)
        self.comm.Allgatherv(send, [recv, counts, displs, self._mpi.BYTE])
        return [recv[d : d + n].tobytes() for d, n in zip(displs, counts)]

    def all_to_all(self, send: Sequence[bytes], recv_lengths: Sequence[int]) -> List[bytes]:
        import numpy as np

        scounts = [len(b) for b in send]
        sdispls = [sum(scounts[:i]) for i in range(len(scounts))]
        rcounts = [int(n) for n in recv_lengths]
        rdispls = [sum(rcounts[:i]) for i in range(len(rcounts))]
        sbuf = np.frombuffer(b"".join(send), dtype=np.uint8)
        rbuf = np.empty(sum(rcounts), dtype=np.uint8)
        self.comm.Alltoallv([sbuf, scounts, sdispls, self._mpi.BYTE], [rbuf, rcounts, rdispls, self._mpi.BYTE])
        return [rbuf[d : d + n].tobytes() for d, n in zip(rdispls, rcounts)]
