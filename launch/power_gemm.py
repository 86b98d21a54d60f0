"""The board's power and SM clock while each decode GEMM runs, beside cuBLAS's dense FP8 GEMM in the same run.

    python launch/power_gemm.py [--seconds 3] [--ramp-seconds 3] [--json FILE]

An H200 running FP8 GEMMs sits at its power limit (700 W), and the clock it then allows sets how many
FLOPs per second the tensor cores can deliver. This replays each case for ``--seconds`` (CUDA graphs, no
gaps) while ``nvidia-smi`` samples power and SM clock every 100 ms, and prints per case the kernel time
(median of CUDA-event timed bursts), TFLOP/s, weight bytes per second, the median power and SM clock over
the window's middle, and the FLOPs per clock per SM they imply (the dense FP8 peak of an H100/H200 SXM SM
is 8192: 1979 TFLOP/s at 1830 MHz on 132 SMs). The driver's power reading trails the load by about a
second, so windows much shorter than the default 3 s read low.

Then (``--ramp-seconds``) each case again from an idle GPU, replay by replay, as TFLOP/s per interval of time
since the start: the first milliseconds run at a clock the board cannot sustain, which is what a short
benchmark, or one that idles between timings, reports.

Cases: ``grouped_gemm_fp8_block_masked`` on 32 experts x {16, 64, 128} rows at (N, K) = (4096, 7168), plain
and packed weights (three weight sets, so that none stays in L2), then ``torch._scaled_mm`` rowwise on one
8192^3 GEMM. Needs a GPU and ``nvidia-smi``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import EXIT_NO_GPU, capture_graph, require_gpus  # noqa: E402

require_gpus(1)

from bench_gemm import _fp8_rows, _fp8_weights  # noqa: E402

import flashinfer_moe as fm  # noqa: E402

PEAK_FLOP_PER_CLOCK = 8192  # dense FP8 per SM per clock, Hopper SXM


def _soak(fn, calls: int, seconds: float) -> tuple[float, float, float]:
    """``(us per call, start, end)`` of ``seconds`` of back-to-back graph replays of ``fn(0 .. calls - 1)``;
    the window returned leaves out the first 30% (the clock settling) and the last 10%."""
    graph = capture_graph(fn, calls)
    time.sleep(0.5)  # idle between cases, so that each starts from the same state
    start, bursts = time.time(), []
    while time.time() - start < seconds:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            graph.replay()
        b.record()
        torch.cuda.synchronize()
        bursts.append(a.elapsed_time(b) * 1e3 / (10 * calls))
    end = time.time()
    return statistics.median(bursts), start + 0.3 * (end - start), end - 0.1 * (end - start)


def _ramp(fn, calls: int, seconds: float, idle: float) -> list[tuple[float, float]]:
    """``[(ms since the first replay began, us per call)]``, one per replay, over ``seconds`` of back-to-back
    replays of ``fn(0 .. calls - 1)`` started after ``idle`` seconds of an idle GPU."""
    graph = capture_graph(fn, calls)
    time.sleep(idle)
    events = [torch.cuda.Event(enable_timing=True)]
    events[0].record()
    start = time.time()
    while time.time() - start < seconds:
        # Ten replays per synchronization: the queue stays short, and the gap a sync leaves is ~1% of them.
        for _ in range(10):
            graph.replay()
            events.append(torch.cuda.Event(enable_timing=True))
            events[-1].record()
        torch.cuda.synchronize()
    return [
        (events[0].elapsed_time(events[i]), events[i].elapsed_time(events[i + 1]) * 1e3 / calls)
        for i in range(len(events) - 1)
    ]


RAMP_BINS_MS = ((0, 10), (10, 50), (50, 200), (200, 1000), (1000, 3000))


def _ramp_row(name: str, points: list[tuple[float, float]], flops: float) -> dict:
    """TFLOP/s in each of RAMP_BINS_MS (replays that began in the bin: total FLOPs over total time)."""
    row = {"case": name}
    for lo, hi in RAMP_BINS_MS:
        sel = [us for t, us in points if lo <= t < hi]
        if sel:
            row[f"tflops_{lo}_{hi}ms"] = flops * len(sel) / sum(sel) / 1e6
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument(
        "--ramp-seconds",
        type=float,
        default=3.0,
        help="also time each case replay by replay for this long after 2 s idle, binned by time since the start "
        "(how far a short benchmark overstates the sustained rate); 0 skips it",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if shutil.which("nvidia-smi") is None:
        print("power_gemm.py needs nvidia-smi (to sample power and clocks), and it is not on PATH", file=sys.stderr)
        sys.exit(EXIT_NO_GPU)
    smi = subprocess.Popen(
        [
            "nvidia-smi",
            f"--id={torch.cuda.current_device()}",
            "--query-gpu=timestamp,power.draw,clocks.sm",
            "--format=csv,noheader,nounits",
            "-lms",
            "100",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    cases = []  # (name, us, start, end, flops, weight bytes)
    ramps = []
    num_experts, n, k, sets = 32, 4096, 7168, 3
    ws = [_fp8_weights(num_experts, n, k) for _ in range(sets)]
    packed = [fm.pack_fp8_block_weights(w) for w, _ in ws]
    for per_expert in (16, 64, 128):
        a, a_s = _fp8_rows(num_experts * per_expert, k)
        a, a_s = a.view(num_experts, per_expert, k), a_s.view(num_experts, per_expert, -1)
        counts = torch.full((num_experts,), per_expert, dtype=torch.int32, device="cuda")
        out = torch.empty(num_experts, per_expert, n, dtype=torch.bfloat16, device="cuda")
        for label, weights in (("plain", [w for w, _ in ws]), ("packed", packed)):

            def call(i, a=a, a_s=a_s, weights=weights, counts=counts, out=out):
                w_scale = ws[i % sets][1]
                fm.grouped_gemm_fp8_block_masked(a, a_s, weights[i % sets], w_scale, counts, out=out)

            name, flops = f"masked {per_expert} rows, {label}", 2.0 * num_experts * per_expert * n * k
            us, t0, t1 = _soak(call, 6, args.seconds)
            cases.append((name, us, t0, t1, flops, num_experts * n * k))
            if args.ramp_seconds > 0:
                ramps.append(_ramp_row(name, _ramp(call, 6, args.ramp_seconds, 2.0), flops))
    m = 8192
    x = torch.randn(m, m, device="cuda").to(torch.float8_e4m3fn)
    y = torch.randn(m, m, device="cuda").to(torch.float8_e4m3fn).t()
    sx, sy = torch.rand(m, 1, device="cuda") + 0.5, torch.rand(1, m, device="cuda") + 0.5

    def dense(i):
        torch._scaled_mm(x, y, sx, sy, out_dtype=torch.bfloat16)

    us, t0, t1 = _soak(dense, 2, args.seconds)
    cases.append(("torch._scaled_mm rowwise 8192^3", us, t0, t1, 2.0 * m**3, 0))
    if args.ramp_seconds > 0:
        ramps.append(_ramp_row(cases[-1][0], _ramp(dense, 2, args.ramp_seconds, 2.0), 2.0 * m**3))
    time.sleep(0.3)
    smi.terminate()
    samples = []
    for line in smi.stdout.read().splitlines():
        try:
            stamp, power, clock = (f.strip() for f in line.split(","))
            # nvidia-smi prints local time, which is what a naive datetime's timestamp() takes it for.
            samples.append(
                (datetime.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp(), float(power), float(clock))
            )
        except ValueError:
            continue
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name, us, t0, t1, flops, weight_bytes in cases:
        window = [(p, c) for t, p, c in samples if t0 <= t <= t1]
        row = dict(case=name, us=us, tflops=flops / us / 1e6, samples=len(window))
        if weight_bytes:
            row["weight_tb_s"] = weight_bytes / us / 1e6
        if window:
            row["power_w"] = statistics.median(p for p, _ in window)
            row["sm_clock_mhz"] = statistics.median(c for _, c in window)
            row["flop_per_clock_per_sm"] = flops / (us * 1e-6) / (row["sm_clock_mhz"] * 1e6) / sms
            row["of_peak_per_clock"] = row["flop_per_clock_per_sm"] / PEAK_FLOP_PER_CLOCK
        rows.append(row)
        print(json.dumps(row), flush=True)
    for row in ramps:
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"sustained": rows, "ramp": ramps}, indent=1))


if __name__ == "__main__":
    main()
