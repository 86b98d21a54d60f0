"""``EPMoELayer`` on GPUs. One GPU: several ranks sharing it (processes joined over CUDA IPC, gloo for the
bootstrap, the P2P all-to-all between them) and ``W = 1``, equal to ``MoELayer`` on the same weights in both
modes, bf16 and FP8, including CUDA-graph replay of the decode path on fresh inputs. Several GPUs (multigpu
tier): one rank per GPU over NCCL, both backends."""

from __future__ import annotations

import os

import pytest
import torch
from ep_cases import TOLERANCE, E, Reference, build, checkpoint, relative_error, skewed_logits, tokens
from launcher import run_ranks

LOW_LATENCY_TOKENS = 24  # ep_cases.build's low_latency_max_tokens


def _seed() -> int:
    return int.from_bytes(os.urandom(3), "little")


def _graph_replays(layer, ref, seed: int, rank: int, device) -> list[float]:
    """The low-latency forward captured once and replayed on fresh tokens: each replay against the reference."""
    x = tokens(seed, rank, LOW_LATENCY_TOKENS - rank, device)
    layer(x)  # compiles and allocates outside the capture
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = layer(x)
    torch.cuda.current_stream().wait_stream(stream)
    errors = []
    for step in range(3):
        x.copy_(tokens(seed + 100 + step, rank, x.shape[0], device))
        out.fill_(float("nan"))  # poisoned: a replay that writes nothing cannot pass
        graph.replay()
        torch.cuda.synchronize()
        errors.append(relative_error(out, ref(x)))
    return errors


def _ranks_agree(rank: int, world: int, seed: int, backend: str, share: bool) -> list[tuple[str, float, float]]:
    torch.cuda.set_device(0 if share else rank)
    device = torch.device("cuda", torch.cuda.current_device())
    results = []
    for fp8 in (False, True):
        weights = checkpoint(seed + fp8, fp8=fp8)
        for quant in (None, "fp8_block", "nvfp4") if not fp8 else ("fp8_block",):
            ref = Reference(quant, device, weights)
            ref(tokens(seed, rank, 4, device))  # compiles this rank's kernels before any peer waits on it
            torch.cuda.synchronize()
            for mode in ("high_throughput", "low_latency", "auto"):
                layer = build(None, quant, mode, device, weights, backend=backend, timeout_s=120)
                if quant == "nvfp4" and mode == "low_latency":  # the decode layer's packed weights (split bits)
                    layer.pack_weights()
                assert layer.backend == (backend if world > 1 else "local"), (layer.backend, layer.fallback_reason)
                tag = f"{quant} {'fp8 ckpt' if fp8 else 'bf16 ckpt'} {mode}"
                # Each size twice on fresh tokens: in low-latency mode the second call replays a CUDA graph.
                for count in (LOW_LATENCY_TOKENS - 2 * rank, 0 if rank == 1 else 1) * 2:
                    x = tokens(seed + count + len(results), rank, count, device)
                    results.append((f"{tag} T={count}", relative_error(layer(x), ref(x)), TOLERANCE[quant]))
                x = tokens(seed, rank, 13, device)
                logits = skewed_logits(x, range(E - E // max(world, 1), E))  # every token to the last rank
                results.append((f"{tag} skewed", relative_error(layer(x, logits), ref(x, logits)), TOLERANCE[quant]))
                if mode == "auto":
                    x = tokens(seed, rank, 45, device)  # above the low-latency bound: the other exchange
                    results.append((f"{tag} T=45", relative_error(layer(x), ref(x)), TOLERANCE[quant]))
                if mode == "low_latency":
                    for i, err in enumerate(_graph_replays(layer, ref, seed, rank, device)):
                        results.append((f"{tag} graph replay {i}", err, TOLERANCE[quant]))
                layer.close()
    return results


def _assert_all(results, seed, world):
    for rank, cases in enumerate(results):
        assert cases, f"rank {rank} ran no case"
        for name, err, tol in cases:
            assert err < tol, f"seed {seed} rank {rank}/{world} {name}: relative error {err:.3g} >= {tol}"


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2, 3])
def test_gpu_ep_layer_ranks_sharing_one_gpu(world):
    # gloo bootstraps the group (NCCL refuses two ranks on one GPU); the layer's all-to-all is P2P over IPC.
    seed = _seed()
    results = run_ranks(_ranks_agree, world, seed, "p2p", True, timeout_s=900)
    _assert_all(results, seed, world)


@pytest.mark.multigpu
@pytest.mark.parametrize("backend", ["p2p", "nccl"])
def test_gpu_ep_layer_one_rank_per_gpu(backend):
    world = min(torch.cuda.device_count(), 4)
    seed = _seed()
    _assert_all(run_ranks(_ranks_agree, world, seed, backend, False, backend="nccl", timeout_s=900), seed, world)
