"""Pieces shared by the expert-parallel job (``launch/ep_moe.py``) and benchmark (``launch/bench_ep.py``).

- :data:`PRESETS` / :class:`MoEConfig`: the MoE layers of real models (DeepSeek-V3, Kimi-K2, Qwen3, Mixtral)
  and a tiny one for CPUs, with the keyword arguments ``EPMoELayer`` and ``MoELayer`` take.
- :class:`RandomMoEWeights`: random weights in the Hugging Face layout, each tensor made when it is looked up
  from a generator seeded by (seed, layer, name), so that every rank builds the same global weights without
  communicating and makes only the ones it reads.
- :func:`init_distributed`: the process group from ``torchrun``, ``mpirun`` or a lone process;
  :func:`run_job`: that, the job's body, and an exit on every rank whatever happened (errors reported, the
  group torn down within a bound); :class:`RankParser`: argparse whose errors print once per job.
- :func:`gather_rows`, :func:`time_per_call`, :class:`Log`, :func:`save_checkpoint`, :func:`hf_prefix`,
  :func:`memory_estimate`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import re
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist

# NVLink multicast (NVLS) stays off in NCCL, torch's symmetric memory and NVSHMEM: not every machine we run on
# supports it (launch/gpu_suite.sh sets the same). Read when the communicators start, so set before that.
COMM_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class UsageError(Exception):
    """A bad combination of options, found after start-up: reported once, exit status 2 on every rank."""


def env_rank() -> int:
    """This process's rank from the launcher's variables, before torch.distributed starts (0 alone)."""
    for key in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


class RankParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are printed by rank 0 only: every rank parses the same command line
    and exits 2, with one message for the job."""

    def error(self, message: str):
        if env_rank() == 0:
            super().error(message)
        sys.exit(2)


def positive(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative(text: str) -> int:
    """argparse type: an int >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


class Log:
    """Progress lines from rank 0, with the seconds since the job started."""

    def __init__(self, rank: int):
        self.rank, self.start = rank, time.perf_counter()

    def __call__(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[{time.perf_counter() - self.start:7.1f}s] {msg}", flush=True)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Shapes and routing of one MoE layer (``shared_intermediate`` None: ``shared_experts * intermediate``)."""

    experts: int
    top_k: int
    hidden: int
    intermediate: int
    scoring_func: str = "softmax"
    renormalize: bool = True
    num_expert_group: int | None = None
    topk_group: int | None = None
    correction_bias: bool = False
    routed_scaling_factor: float | None = None
    shared_experts: int = 0
    shared_intermediate: int | None = None

    @property
    def shared_size(self) -> int:
        return self.shared_intermediate or self.shared_experts * self.intermediate

    def routing_kwargs(self) -> dict:
        """The routing keyword arguments of ``MoELayer`` and ``EPMoELayer``."""
        return dict(
            scoring_func=self.scoring_func,
            renormalize=self.renormalize,
            num_expert_group=self.num_expert_group,
            topk_group=self.topk_group,
            correction_bias=self.correction_bias,
            routed_scaling_factor=self.routed_scaling_factor,
        )

    def shared_kwargs(self) -> dict:
        """The shared-expert keyword arguments of ``EPMoELayer``."""
        if not self.shared_experts:
            return {}
        return dict(num_shared_experts=self.shared_experts, shared_intermediate_size=self.shared_size)

    def problems(self) -> list[str]:
        """What is wrong with the shapes (after --experts and the like scaled a preset), as option hints."""
        out = []
        if min(self.experts, self.top_k, self.hidden, self.intermediate) < 1:
            out.append("--experts, --top-k, --hidden and --intermediate must be positive")
        elif self.top_k > self.experts:
            out.append(f"--top-k {self.top_k} must be at most --experts {self.experts}")
        g = self.num_expert_group
        if g is not None and self.experts >= 1:
            if self.experts % g:
                out.append(f"--experts must be a multiple of the {g} expert groups of this model, got {self.experts}")
            elif self.top_k > self.topk_group * (self.experts // g):
                out.append(
                    f"--top-k {self.top_k} is more than the {self.topk_group} selected groups of "
                    f"{self.experts // g} experts hold"
                )
        return out


PRESETS: dict[str, MoEConfig] = {
    "deepseek-v3": MoEConfig(
        256, 8, 7168, 2048, "sigmoid", True, 8, 4, True, 2.5, shared_experts=1
    ),  # also DeepSeek-R1
    "kimi-k2": MoEConfig(384, 8, 7168, 2048, "sigmoid", True, 1, 1, True, 2.827, shared_experts=1),
    "qwen3-235b": MoEConfig(128, 8, 4096, 1536),  # Qwen3-235B-A22B
    "qwen3-30b": MoEConfig(128, 8, 2048, 768),  # Qwen3-30B-A3B
    "mixtral": MoEConfig(8, 2, 4096, 14336),  # Mixtral-8x7B
    # The DeepSeek-V3 routing in small: 24 experts split over 1, 2, 3, 4, 6 or 8 ranks; H and I multiples of
    # 128 so the FP8 block format applies.
    "tiny": MoEConfig(24, 4, 256, 128, "sigmoid", True, 4, 2, True, 2.5, shared_experts=1),
}


def hf_prefix(layer: int) -> str:
    """The key prefix of one MoE layer's weights in a Hugging Face checkpoint."""
    return f"model.layers.{layer}.mlp."


def _seed(*parts) -> int:
    """A 63-bit seed from its parts, the same in every process (Python's hash() of a str is salted)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def generator(device: torch.device, *parts) -> torch.Generator:
    """A generator on ``device`` seeded by ``parts`` (e.g. ``(seed, "hidden", rank, step)``)."""
    return torch.Generator(device=device).manual_seed(_seed(*parts))


_KEY = re.compile(
    r"model\.layers\.(\d+)\.mlp\."
    r"(?:(gate)\.(weight|e_score_correction_bias)"
    r"|(?:experts\.(\d+)|(shared_experts))\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv))"
)


class RandomMoEWeights(Mapping):
    """Random weights of MoE layers ``first_layer ..`` under Hugging Face names, made on demand.

    Keys, with ``p = hf_prefix(layer)``: ``{p}gate.weight`` `[E, H]`, ``{p}gate.e_score_correction_bias`` `[E]`
    (with a correction bias), ``{p}experts.{e}.{gate,up,down}_proj.weight`` and, with shared experts,
    ``{p}shared_experts.{gate,up,down}_proj.weight``; with ``fp8_block`` the projections are float8_e4m3fn
    with a ``.weight_scale_inv`` (128 x 128 blocks, as DeepSeek-V3 ships them), else bf16.

    Each tensor comes from a generator seeded by (seed, layer, name) on ``device``: the same in every process
    on the same kind of device (CPU and CUDA generators differ). Weights are ``randn / sqrt(fan_in)``, so
    each projection keeps activations O(1); the bias is uniform in [-0.1, 0.1). Looking a key up costs the
    generation; ``in`` costs nothing. The last projection is cached, so that a weight and its scale are one
    generation.
    """

    def __init__(
        self,
        cfg: MoEConfig,
        num_layers: int,
        seed: int,
        device: torch.device | str = "cpu",
        *,
        fp8_block: bool = False,
        first_layer: int = 0,
    ):
        self.cfg, self.seed, self.device, self.fp8_block = cfg, seed, torch.device(device), fp8_block
        self.layers = range(first_layer, first_layer + num_layers)
        self._cache: tuple[tuple, tuple[torch.Tensor, torch.Tensor | None]] | None = None

    def _parse(self, key: object):
        """``(layer, what, expert, projection, suffix)`` of a key this mapping holds, else None."""
        m = _KEY.fullmatch(key) if isinstance(key, str) else None
        if m is None:
            return None
        layer, gate, gate_what, expert, shared, proj, suffix = m.groups()
        layer = int(layer)
        if layer not in self.layers:
            return None
        if gate:
            bias = gate_what == "e_score_correction_bias"
            return None if bias and not self.cfg.correction_bias else (layer, gate_what, None, None, None)
        if suffix == "weight_scale_inv" and not self.fp8_block:
            return None
        if shared:
            return (layer, "shared", None, proj, suffix) if self.cfg.shared_experts else None
        expert = int(expert)
        if expert >= self.cfg.experts or str(expert) != m.group(4):  # "007" is not a key
            return None
        return layer, "expert", expert, proj, suffix

    def __contains__(self, key: object) -> bool:
        return self._parse(key) is not None

    def __getitem__(self, key: str) -> torch.Tensor:
        parsed = self._parse(key)
        if parsed is None:
            raise KeyError(key)
        layer, what, expert, proj, suffix = parsed
        cfg, dev = self.cfg, self.device
        if what == "weight":  # the router
            g = generator(dev, self.seed, layer, "gate.weight")
            return (torch.randn(cfg.experts, cfg.hidden, generator=g, device=dev) * cfg.hidden**-0.5).bfloat16()
        if what == "e_score_correction_bias":
            g = generator(dev, self.seed, layer, "gate.bias")
            return torch.rand(cfg.experts, generator=g, device=dev) * 0.2 - 0.1
        name = f"experts.{expert}.{proj}" if what == "expert" else f"shared_experts.{proj}"
        if self._cache is None or self._cache[0] != (layer, name):
            inner = cfg.intermediate if what == "expert" else cfg.shared_size
            rows, cols = (cfg.hidden, inner) if proj == "down_proj" else (inner, cfg.hidden)
            g = generator(dev, self.seed, layer, name)
            w = (torch.randn(rows, cols, generator=g, device=dev) * cols**-0.5).bfloat16()
            if self.fp8_block:
                from flashinfer_moe import quantize_fp8_block_weights

                self._cache = ((layer, name), quantize_fp8_block_weights(w))
            else:
                self._cache = ((layer, name), (w, None))
        return self._cache[1][0 if suffix == "weight" else 1]

    def __iter__(self) -> Iterator[str]:
        suffixes = ("weight", "weight_scale_inv") if self.fp8_block else ("weight",)
        for layer in self.layers:
            p = hf_prefix(layer)
            yield f"{p}gate.weight"
            if self.cfg.correction_bias:
                yield f"{p}gate.e_score_correction_bias"
            owners = [f"experts.{e}" for e in range(self.cfg.experts)]
            owners += ["shared_experts"] if self.cfg.shared_experts else []
            for owner in owners:
                for proj in _PROJECTIONS:
                    for suffix in suffixes:
                        yield f"{p}{owner}.{proj}.{suffix}"

    def __len__(self) -> int:
        per_projection = 2 if self.fp8_block else 1
        owners = self.cfg.experts + (1 if self.cfg.shared_experts else 0)
        per_layer = 1 + int(self.cfg.correction_bias) + owners * 3 * per_projection
        return per_layer * len(self.layers)


def save_checkpoint(weights: Mapping, directory: str | Path, log=print, max_file_bytes: int = 2 << 30) -> int:
    """Writes every tensor of ``weights`` to ``directory`` as safetensors files of about ``max_file_bytes``
    (``model-00001.safetensors`` ...) with a ``model.safetensors.index.json`` naming the file of each tensor,
    as Hugging Face shards are laid out. Returns the number of files. One process writes."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weight_map, shard, size, total, files = {}, {}, 0, 0, 0

    def flush():
        nonlocal shard, size, files
        if shard:
            files += 1
            name = f"model-{files:05d}.safetensors"
            save_file(shard, str(directory / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            log(f"wrote {directory / name} ({len(shard)} tensors, {size / 2**20:.1f} MiB)")
            shard, size = {}, 0

    for key in weights:
        t = weights[key].detach().to("cpu").contiguous()
        shard[key] = t
        size += t.numel() * t.element_size()
        total += t.numel() * t.element_size()
        if size >= max_file_bytes:
            flush()
    flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return files


def memory_estimate(cfg: MoEConfig, num_layers: int, quant: str | None) -> dict:
    """Bytes for the expert-parallel layers on all ranks together and for the single-process reference on
    rank 0 (its weights plus every expert's source tensors, which ``MoELayer.load_expert_weights`` holds at
    once), and the random values generated (the layers' and the reference's)."""
    routed = cfg.experts * 3 * cfg.hidden * cfg.intermediate
    shared = 3 * cfg.hidden * cfg.shared_size
    weight_bytes = 1 if quant else 2
    source_bytes = 1 if quant == "fp8_block" else 2
    return {
        "layers_bytes": num_layers * (routed + shared) * weight_bytes,
        "reference_bytes": routed * (weight_bytes + source_bytes) + shared * 4,
        "random_values": (num_layers + 1) * (routed + shared),
    }


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclasses.dataclass
class DistEnv:
    """Where this process stands: ``group`` runs the layers (NCCL, or gloo on CPUs and with a shared GPU);
    ``cpu_group`` is a gloo group over the same ranks with a long timeout, for gathers of CPU tensors and
    for waiting while rank 0 checks results."""

    rank: int
    world: int
    device: torch.device
    backend: str
    launcher: str
    group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup
    shared_gpu: bool = False  # every rank on cuda:0 (asked for, or more ranks than GPUs on the host)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(share_gpu: bool = False, timeout_s: float = 120.0, cpu_timeout_s: float = 900.0) -> DistEnv:
    """Starts ``torch.distributed``: from ``torchrun``'s variables (RANK, WORLD_SIZE, LOCAL_RANK), from MPI
    (``mpirun``: OMPI_COMM_WORLD_SIZE or PMI_SIZE set, through ``flashinfer_moe.comm.bootstrap.init_from_mpi``),
    or as a lone rank. With CUDA each rank takes ``cuda:{local rank}`` and NCCL; with ``share_gpu`` every rank
    takes cuda:0 and gloo (NCCL refuses two ranks on one GPU); without CUDA, CPU and gloo. ``timeout_s``
    bounds the start and every operation of ``group``.

    More ranks on the host than GPUs share cuda:0 as with ``share_gpu``.
    """
    for key, value in COMM_ENV.items():
        os.environ.setdefault(key, value)
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda and not share_gpu else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher, local_rank = "torchrun", int(env.get("LOCAL_RANK", "0"))
        local_size = int(env.get("LOCAL_WORLD_SIZE", "1"))
    elif "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env:
        launcher, local_rank = "mpirun", None  # init_from_mpi finds it
        local_size = int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", env.get("MPI_LOCALNRANKS", "1")))
    else:
        launcher, local_rank, local_size = "single process", 0, 1
    if backend == "nccl" and local_size > torch.cuda.device_count():
        # More ranks than GPUs (e.g. the README's two ranks on a one-GPU machine): share GPU 0, as --share-gpu.
        share_gpu, backend = True, "gloo"
    if launcher == "mpirun":
        from flashinfer_moe.comm.bootstrap import init_from_mpi

        init_from_mpi(backend=backend, timeout_s=timeout_s)
        device = torch.device("cuda", 0 if share_gpu else torch.cuda.current_device()) if cuda else None
    else:
        device = torch.device("cuda", 0 if share_gpu else local_rank) if cuda else None
        if device is not None:
            torch.cuda.set_device(device)
        kwargs = {"device_id": device} if backend == "nccl" else {}
        if launcher == "single process":
            kwargs.update(init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        dist.init_process_group(backend, timeout=timeout, **kwargs)
    if device is not None:
        torch.cuda.set_device(device)
    cpu_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=max(cpu_timeout_s, timeout_s)))
    return DistEnv(
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        device=device or torch.device("cpu"),
        backend=backend,
        launcher=launcher,
        group=dist.group.WORLD,
        cpu_group=cpu_group,
        shared_gpu=bool(share_gpu and cuda),
    )


def gather_rows(t: torch.Tensor, group: dist.ProcessGroup, dst: int = 0) -> list[torch.Tensor] | None:
    """Every rank's `[T_r, ...]` tensor (``T_r`` may differ) on rank ``dst`` of a gloo ``group``, as a list by
    rank (None elsewhere). Collective. Moves through the CPU as bytes (gloo gathers few dtypes)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    x = t.detach().cpu().contiguous()
    bits = x.view(torch.uint8)  # [..., n * itemsize]
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([x.shape[0]]), group=group)
    padded = bits.new_zeros((int(max(sizes)), *bits.shape[1:]))
    padded[: x.shape[0]] = bits
    out = [torch.empty_like(padded) for _ in range(world)] if rank == dst else None
    dist.gather(padded, out, dst=dist.get_global_rank(group, dst), group=group)
    if out is None:
        return None
    return [o[: int(n)].view(x.dtype) for o, n in zip(out, sizes, strict=True)]


def sync(device: torch.device) -> None:
    """Waits for the device's work (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one eager call of ``fn``: CUDA events on a GPU (waited for), the wall clock on a CPU."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def time_per_call(fn: Callable[[], object], env: DistEnv, reps: int) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn`` (eager; all ranks start together), the slowest rank's per
    repeat. Collective."""
    samples = []
    for _ in range(reps):
        dist.barrier(group=env.cpu_group)
        samples.append(time_once(fn, env.device))
    t = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(t, dist.ReduceOp.MAX, group=env.cpu_group)
    return t.tolist()


def _teardown() -> None:
    """Destroys the process group within 10 s: after an error a peer may never join the teardown."""
    if dist.is_initialized():
        worker = threading.Thread(target=dist.destroy_process_group, daemon=True)
        worker.start()
        worker.join(timeout=10)


def run_job(body: Callable[[DistEnv], int], *, prog: str, share_gpu: bool = False, timeout_s: float = 120.0):
    """Starts the process group (:func:`init_distributed`), runs ``body(env)`` (its return value is the exit
    status) and exits. A :class:`UsageError` is printed once (rank 0) as ``{prog}: error: ...``, exit 2; any
    other exception is printed with its traceback by the rank that raised it, exit 1. Never returns."""
    env, code = None, 1
    try:
        env = init_distributed(share_gpu=share_gpu, timeout_s=timeout_s)
        code = body(env)
    except UsageError as exc:  # every rank finds the same problem
        code = 2
        if (env.rank if env else env_rank()) == 0:
            print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
    except (Exception, KeyboardInterrupt):
        rank = env.rank if env else env_rank()
        print(f"rank {rank}: error:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    finally:
        _teardown()
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)  # skip interpreter teardown: it may wait on communication threads of dead peers
    sys.exit(0)
