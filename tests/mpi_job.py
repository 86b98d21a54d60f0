"""Run under mpiexec by test_comm_bootstrap.py: the process group from MPI, then a dispatch and a combine
checked against what every rank can compute from the shared seed."""

import sys

import torch

from flashinfer_moe.comm.bootstrap import init_from_mpi
from flashinfer_moe.comm.collective import CollectiveAllToAll


def main() -> int:
    backend = sys.argv[1] if len(sys.argv) > 1 else None
    group = init_from_mpi(backend=backend)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
    comm = CollectiveAllToAll(group, num_experts=4 * world, top_k=2, hidden_size=32, max_tokens_per_rank=8)
    g = torch.Generator().manual_seed(1234 + rank)
    h = torch.randn(6, 32, generator=g).bfloat16().to(device)
    ids = torch.rand(6, 4 * world, generator=g).argsort(-1)[:, :2].int().to(device)
    got = comm.dispatch(h, ids, torch.rand(6, 2, generator=g).to(device))
    out = comm.combine(got.hidden_states, got.handle)  # each token back once per rank it went to
    ranks = ((ids // 4).unsqueeze(-1) == torch.arange(world, device=device)).any(1).sum(-1, keepdim=True)
    assert torch.equal(out, (h.float() * ranks).bfloat16()), f"rank {rank}"
    print(f"rank {rank} of {world} ok ({torch.distributed.get_backend()})", flush=True)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
