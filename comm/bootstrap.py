"""Bringing up the process group the communicators run on: from ``torchrun`` (``torch.distributed``) or from
an mpi4py communicator (``mpirun``), so that both kinds of job build the same communicators."""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

__all__ = ["init_from_mpi"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def init_from_mpi(comm=None, *, backend: str | None = None, timeout_s: float = 300.0) -> dist.ProcessGroup:
    """Initializes ``torch.distributed`` over the ranks of an mpi4py communicator and returns the group.

    Rank 0 of ``comm`` picks the rendezvous address (loopback when every rank shares its host) and
    broadcasts it over MPI; every rank then joins with its MPI rank. With NCCL each rank first takes the GPU
    of its rank on the host.

    Args:
        comm: an ``mpi4py.MPI.Comm``; default ``MPI.COMM_WORLD``.
        backend: ``"nccl"`` or ``"gloo"``; default NCCL where CUDA is available.
        timeout_s: the process group's timeout for its own operations.

    Returns:
        The default process group (what ``CollectiveAllToAll(group)`` takes).
    """
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError("init_from_mpi needs mpi4py: pip install 'flashinfer-moe[mpi]'") from exc
    comm = MPI.COMM_WORLD if comm is None else comm
    rank, size = comm.Get_rank(), comm.Get_size()
    if dist.is_initialized():
        if dist.get_world_size() != size or dist.get_rank() != rank:
            raise ValueError(
                f"comm must match the torch.distributed group already initialized (rank {dist.get_rank()} of "
                f"{dist.get_world_size()}), got rank {rank} of {size}"
            )
        return dist.group.WORLD
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    host_comm = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank, local_size = host_comm.Get_rank(), host_comm.Get_size()
    host_comm.Free()
    if backend == "nccl":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    address = None
    if rank == 0:
        single_host = comm.allreduce(local_size, op=MPI.MIN) == size
        ip = "127.0.0.1" if single_host else socket.gethostbyname(socket.gethostname())
        address = f"tcp://{ip}:{_free_port()}"
    else:
        comm.allreduce(local_size, op=MPI.MIN)
    address = comm.bcast(address, root=0)
    dist.init_process_group(
        backend, init_method=address, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=timeout_s)
    )
    return dist.group.WORLD
