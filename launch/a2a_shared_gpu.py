"""Correctness smoke of the one-shot P2P all-to-all with several ranks on ONE GPU.

Spawns ``--world`` processes, every one on the same GPU, joined in a gloo process group over a free localhost
port (NCCL refuses two ranks on one GPU; the P2P backend bootstraps over any group). Each builds
``MoEAllToAll(backend="p2p")`` with E = 8 * world experts, top-4, H = 512 (and 7168 once), 64 tokens per rank
at most, in both modes, bf16 and FP8 rows, and checks dispatch and combine EXACTLY against the reference of the
CPU tests (``tests/test_comm_alltoall.py``: ``_inputs`` and ``_check_call``) on a few routings: random, a rank
with no tokens, one token per rank, every pair to the last rank's experts. Then, per mode, a timeout: the last
rank skips a dispatch, the others must raise ``CommTimeoutError`` naming it within the 3 s budget, and after
``recover()`` the same processes make correct calls again.

Two processes' kernels on one GPU are time-sliced (no MPS): the kernels' spin-waits progress slowly but they
progress. Nothing is timed here beyond the timeout check: this is a correctness smoke, not a benchmark.

    python launch/a2a_shared_gpu.py --world 2 [--json FILE] [--seed N] [--device 0]

Prints one line per case (PASS/FAIL with details) and exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import socket
import sys
import time
import traceback
from pathlib import Path

# The reference lives with the CPU tests; import it rather than keep a second copy in step.
TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

TOP_K, HIDDEN, BIG_HIDDEN, MAX_TOKENS = 4, 512, 7168, 64
TIMEOUT_BUDGET_S = 3.0  # the timeout cases' timeout_s
TIMEOUT_SLACK_S = 3.0  # past the budget: the send kernel, the host's sync, the raise
CALL_TIMEOUT_S = 20.0  # the other cases' timeout_s: a broken call fails in seconds, not in the default 30 s
FIRST_TIMEOUT_S = "120"  # FLASHINFER_MOE_A2A_FIRST_TIMEOUT_S for the children, unless set already
DONE, ERROR = "__done__", "__error__"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _routings(world: int) -> list[tuple[str, str, list[int]]]:
    """(name, kind of _inputs, tokens per rank); at most MAX_TOKENS each."""
    return [
        ("random", "random", [min(MAX_TOKENS, 37 + 13 * r) for r in range(world)]),
        ("random, rank 1 has no tokens", "random", [0 if r == 1 else 29 + 5 * r for r in range(world)]),
        ("random, one token per rank", "random", [1] * world),
        ("every pair to the last rank", "one_rank", [MAX_TOKENS] + [9] * (world - 2) + [0]),
    ]


def _one_line(exc: BaseException) -> str:
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" [{Path(frame.filename).name}:{frame.lineno}]" if frame else ""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}{where}"


class _Rank:
    """What one rank runs; reports every case to the parent as (rank, case, detail, note): detail None on
    success, else what failed; note what a passing case measured (shown on its line), or None."""

    def __init__(self, rank: int, world: int, seed: int, results):
        import torch.distributed as dist

        self.rank, self.world, self.seed, self.results = rank, world, seed, results
        self.num_experts = 8 * world
        self.dist = dist

    def report(self, case: str, detail: str | None, note: str | None = None) -> None:
        self.results.put((self.rank, case, detail, note))

    def agree(self, detail: str | None) -> bool:
        """Collective: True when no rank failed its part of the case."""
        out = [None] * self.world
        self.dist.all_gather_object(out, detail)
        return not any(out)

    def build(self, mode: str, fp8: bool, hidden: int, timeout_s: float):
        import torch
        from test_comm_alltoall import GROUP

        from flashinfer_moe.comm import MoEAllToAll

        return MoEAllToAll(
            None, num_experts=self.num_experts, top_k=TOP_K, hidden_size=hidden, max_tokens_per_rank=MAX_TOKENS,
            dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, mode=mode, backend="p2p", timeout_s=timeout_s,
            scale_groups=-(-hidden // GROUP),  # the width of the reference's scales
        )  # fmt: skip

    def call(self, comm, seed: int, kind: str, tokens: list[int], hidden: int, fp8: bool) -> None:
        from test_comm_alltoall import _check_call, _inputs

        inputs = _inputs(seed, self.world, tokens, kind, hidden, fp8, num_experts=self.num_experts)
        _check_call(comm, self.rank, self.world, inputs, "cuda", comm.mode)
        comm.check()  # low-latency calls and combines report a recorded error only here

    def case(self, comm, name: str, fn, *args) -> bool:
        """Runs fn(*args); every rank then learns whether any failed, and on a failure all recover() together, so
        that one rank's failed check does not leave the others out of step for the next case."""
        detail = None
        try:
            fn(*args)
        except Exception as exc:
            detail = _one_line(exc)
        ok = self.agree(detail)
        if not ok and comm is not None and comm.backend == "p2p":
            try:
                comm.recover()
            except Exception as exc:
                detail = (detail or "another rank failed") + f"; recover() failed: {_one_line(exc)}"
        self.report(name, detail)
        return ok

    def warm_up(self) -> None:
        """Compiles and loads the layout and permute kernels the low-latency dispatch uses, before any peer
        waits on this rank inside a kernel."""
        import torch

        from flashinfer_moe.comm.collective import _permute_any
        from flashinfer_moe.moe.layout import moe_align_masked

        ids = torch.zeros(2, TOP_K, dtype=torch.int32, device="cuda")
        _permute_any(torch.ones(2, 16, dtype=torch.bfloat16, device="cuda"), moe_align_masked(ids, 2, 4))
        torch.cuda.synchronize()

    def exact(self) -> None:
        configs = [(mode, fp8, HIDDEN) for mode in ("high_throughput", "low_latency") for fp8 in (False, True)]
        configs += [("high_throughput", False, BIG_HIDDEN), ("low_latency", True, BIG_HIDDEN)]
        for index, (mode, fp8, hidden) in enumerate(configs):
            label = f"{mode} {'fp8' if fp8 else 'bf16'} H={hidden}"
            routings = _routings(self.world) if hidden == HIDDEN else _routings(self.world)[:1]
            comm, detail = None, None
            try:
                comm = self.build(mode, fp8, hidden, CALL_TIMEOUT_S)
                if comm.backend != "p2p":
                    detail = f"backend {comm.backend!r}, fallback_reason {comm.fallback_reason!r}"
            except Exception as exc:  # collective: every rank raises alike
                detail = _one_line(exc)
            if not self.agree(detail) or comm is None:
                self.report(f"{label}: build", detail)
                continue
            for number, (name, kind, tokens) in enumerate(routings):
                seed = self.seed + 100 * index + number  # the same on every rank: each builds the reference

                name = f"{label}: {name}, T={tokens} (seed {seed})"
                self.case(comm, name, self.call, comm, seed, kind, tokens, hidden, fp8)
            comm.close()

    def timeout(self, mode: str) -> None:
        """The last rank skips one dispatch; the others raise CommTimeoutError naming it within the budget;
        every rank recovers and makes correct calls again, in the same processes."""
        import torch

        from flashinfer_moe import CommTimeoutError

        label, skipper = f"timeout {mode}", self.world - 1
        seed = self.seed + 10_000 + (mode == "low_latency")
        comm, detail = None, None
        try:
            comm = self.build(mode, False, HIDDEN, TIMEOUT_BUDGET_S)
        except Exception as exc:
            detail = _one_line(exc)
        if not self.agree(detail) or comm is None:
            self.report(f"{label}: build", detail)
            return
        tokens = [MAX_TOKENS] * self.world
        # The first dispatch and combine get the warm-up bound: the skipped call must be a later one.
        if not self.case(comm, f"{label}: call before", self.call, comm, seed, "random", tokens, HIDDEN, False):
            comm.close()
            return

        def skipped():
            if self.rank == skipper:
                time.sleep(TIMEOUT_BUDGET_S + 4)  # the others give up meanwhile
                return
            from test_comm_alltoall import _inputs

            inputs = _inputs(seed + 1, self.world, tokens, "random", HIDDEN, False, num_experts=self.num_experts)
            h, ids, w, s = (t.cuda() for t in inputs[self.rank])
            start = time.monotonic()
            try:
                comm.dispatch(h, ids, w, scales=s)
                comm.check()
            except CommTimeoutError as exc:
                elapsed = time.monotonic() - start
                problems = []
                if exc.peers != (skipper,) or exc.phase != "dispatch" or f"waiting for rank {skipper}" not in str(exc):
                    problems.append(f"peers {exc.peers}, phase {exc.phase!r}, message {str(exc)!r}")
                if not TIMEOUT_BUDGET_S <= elapsed < TIMEOUT_BUDGET_S + TIMEOUT_SLACK_S:
                    problems.append(f"raised after {elapsed:.2f} s, budget {TIMEOUT_BUDGET_S:g} s")
                x = torch.arange(8, device="cuda", dtype=torch.float32)
                if float((x * 2).sum()) != 56.0:  # the CUDA context stays usable
                    problems.append("the GPU gave a wrong sum after the timeout")
                if problems:
                    raise AssertionError("; ".join(problems)) from None
                return f"raised after {elapsed:.2f} s"
            raise AssertionError(f"rank {self.rank}: no CommTimeoutError although rank {skipper} skipped the call")

        detail = note = None
        try:
            note = skipped()
        except Exception as exc:
            detail = _one_line(exc)
        try:
            comm.recover()  # every rank, the one that skipped too
        except Exception as exc:
            detail = (detail or "") + f"; recover() failed: {_one_line(exc)}"
        self.agree(detail)
        self.report(f"{label}: rank {skipper} skips a dispatch, the others raise naming it", detail, note)
        after = [MAX_TOKENS, 3, 0, 5][: self.world] + [7] * (self.world - 4)
        for call in range(2):
            name = f"{label}: call {call + 1} after recover(), T={after}"
            self.case(comm, name, self.call, comm, seed + 2 + call, "random", after, HIDDEN, False)
        comm.close()


def _rank_main(rank: int, world: int, port: int, device: int, seed: int, results) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(device)  # every rank on the same GPU
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=600),  # the first construction may compile the kernels
        )
        me = _Rank(rank, world, seed, results)
        me.warm_up()
        me.exact()
        for mode in ("high_throughput", "low_latency"):
            me.timeout(mode)
    except BaseException:
        results.put((rank, ERROR, traceback.format_exc(), None))
    finally:
        results.put((rank, DONE, None, None))
        results.close()
        results.join_thread()
        os._exit(0)  # no collective teardown that would wait on a rank that is gone


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="processes, all on one GPU (2..8)")
    parser.add_argument("--device", type=int, default=0, help="the CUDA device every rank uses")
    parser.add_argument("--seed", type=int, default=None, help="default: random")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--deadline", type=float, default=1200.0, help="seconds for the whole run")
    args = parser.parse_args(argv)
    if not 2 <= args.world <= 8:
        parser.error(f"--world must be in 2..8, got {args.world}")

    import torch
    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from timing import require_gpus

    require_gpus(1)  # every rank on the same GPU
    if not 0 <= args.device < torch.cuda.device_count():
        parser.error(f"--device must be in 0..{torch.cuda.device_count() - 1}, got {args.device}")
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(3), "little")
    os.environ.setdefault("FLASHINFER_MOE_A2A_FIRST_TIMEOUT_S", FIRST_TIMEOUT_S)  # the children inherit it
    gpu = torch.cuda.get_device_name(args.device)
    print(f"a2a_shared_gpu: {args.world} ranks on cuda:{args.device} ({gpu}), seed {seed}", flush=True)

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, args.world, port, args.device, seed, results), daemon=True)
        for r in range(args.world)
    ]
    for p in procs:
        p.start()
    by_case: dict[str, dict[int, str | None]] = {}
    order: list[str] = []
    cases: list[dict] = []
    errors: dict[int, str] = {}
    notes: dict[str, list[str]] = {}
    done: set[int] = set()
    failed = False

    def emit(name: str, details: dict[int, str | None]) -> None:
        nonlocal failed
        bad = {r: d for r, d in sorted(details.items()) if d}
        missing = [r for r in range(args.world) if r not in details]
        ok = not bad and not missing
        failed |= not ok
        why = "; ".join(f"rank {r}: {d}" for r, d in bad.items())
        if missing:
            why = (why + "; " if why else "") + f"no report from rank(s) {missing}"
        said = why if why else ", ".join(notes.get(name, []))
        print(f"{'PASS' if ok else 'FAIL'} {name}" + (f": {said}" if said else ""), flush=True)
        cases.append(
            {
                "case": name,
                "status": "PASS" if ok else "FAIL",
                "ranks": {str(r): d for r, d in details.items()},
                "notes": notes.get(name, []),
            }
        )

    deadline = time.monotonic() + args.deadline
    try:
        while len(done) < args.world:
            try:
                rank, name, detail, note = results.get(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline:
                    break
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in done]
                if dead and results.empty():
                    time.sleep(1.0)  # a last message may still be in the pipe
                    if results.empty():
                        for r in dead:
                            errors[r] = f"process ended without reporting (exit code {procs[r].exitcode})"
                            done.add(r)
                continue
            if name == DONE:
                done.add(rank)
            elif name == ERROR:
                errors[rank] = detail
            else:
                if name not in by_case:
                    by_case[name] = {}
                    order.append(name)
                by_case[name][rank] = detail
                if note:
                    notes.setdefault(name, []).append(f"rank {rank} {note}")
                    notes[name].sort()
                if len(by_case[name]) == args.world:
                    emit(name, by_case.pop(name))
                    order.remove(name)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for name in order:  # cases some rank never finished
        emit(name, by_case[name])
    if len(done) < args.world:
        errors.update(
            {r: f"still running after the {args.deadline:g} s deadline" for r in range(args.world) if r not in done}
        )
    for rank, text in sorted(errors.items()):
        failed = True
        print(f"FAIL rank {rank}: {text.strip()}", flush=True)
    if not cases and not errors:
        failed = True
        print("FAIL no case ran", flush=True)
    summary = f"{sum(c['status'] == 'PASS' for c in cases)} of {len(cases)} cases passed"
    print(("FAILED: " if failed else "OK: ") + summary, flush=True)
    if args.json is not None:
        report = {
            "world": args.world, "device": f"cuda:{args.device}", "gpu": gpu, "seed": seed, "ok": not failed,
            "cases": cases, "rank_errors": {str(r): t for r, t in errors.items()},
        }  # fmt: skip
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
