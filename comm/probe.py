"""`flashinfer-moe probe`: what really works between every pair of GPUs, and which all-to-all backend
the library would choose.

A report is a plain dict (the ``--json`` output); :func:`format_report` renders it for a terminal.
Matrices are indexed by position in ``report["devices"]``; row = the GPU that acts (reads, writes,
opens), column = the GPU whose memory is used.
"""

from __future__ import annotations

import json
import os
import queue
import time

SCHEMA_VERSION = 1
EXIT_FIT, EXIT_UNFIT, EXIT_USAGE, EXIT_NO_GPU = 0, 1, 2, 3

LEGEND = {
    "Y / N": "yes / no, as the CUDA runtime reports it",
    "NV#": "NVLink, # links (through NVSwitch where the links end in a switch); NV: NVLink, count not exposed",
    "PIX/PXB/PHB/NODE/SYS": "PCIe path: one switch / several switches / host bridge / across host bridges "
    "in a NUMA node / across NUMA nodes",
    "OK": "the check passed",
    "FAIL": "the flag arrived but the value or payload was wrong",
    "TIMEOUT": "nothing arrived within the timeout (the kernel gave up; nothing hung)",
    "ERROR": "the check could not run (message in --json)",
    "SKIP": "not run: no peer access between the pair",
    "?": "unknown (NVML unavailable)",
    "-": "same GPU",
}

MATRICES = (
    ("peer_access", "Peer access (cudaDeviceCanAccessPeer)"),
    ("link", "Link (NVML)"),
    ("native_atomics", "Native P2P atomics (cudaDevP2PAttrNativeAtomicSupported)"),
    ("live_flag", "Live flag check: row writes (release atomic, system scope), column waits (acquire)"),
    ("ipc", "CUDA IPC across processes: row's memory opened in a second process, written from column"),
    ("bandwidth_gbps", "Copy bandwidth, GB/s, row -> column"),
    ("latency_us", "One-way flag latency, us (ping-pong / 2)"),
)


class NoGPUError(RuntimeError):
    """No CUDA GPU or driver: the probe has nothing to look at."""


def _normalize_bus_id(bus_id: str) -> str:
    domain, bus, devfn = bus_id.strip().lower().split(":")
    return f"{int(domain, 16):08x}:{int(bus, 16):02x}:{devfn}"


def _link_matrix(devices: list[int], bus_ids: list[str]) -> tuple[list[list[str]], str | None]:
    n = len(devices)
    unknown = [["-" if i == j else "?" for j in range(n)] for i in range(n)]
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
    except Exception as exc:
        return unknown, f"NVML unavailable: {type(exc).__name__}: {exc}"
    try:
        handles = [pynvml.nvmlDeviceGetHandleByPciBusId(_normalize_bus_id(b).encode()) for b in bus_ids]
        own = {_normalize_bus_id(b) for b in bus_ids}
        levels = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
        remote_pci = (
            getattr(pynvml, "nvmlDeviceGetNvLinkRemotePciInfo_v2", None) or pynvml.nvmlDeviceGetNvLinkRemotePciInfo
        )
        out = [row[:] for row in unknown]
        for i in range(n):
            direct: dict[str, int] = {}
            to_switch = 0
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(handles[i], link) != pynvml.NVML_FEATURE_ENABLED:
                        continue
                    remote = remote_pci(handles[i], link).busId
                except pynvml.NVMLError:
                    continue
                remote = _normalize_bus_id(remote.decode() if isinstance(remote, bytes) else remote)
                if remote in own:
                    direct[remote] = direct.get(remote, 0) + 1
                else:
                    to_switch += 1
            for j in range(n):
                if i != j:
                    out[i][j] = _link_cell(
                        pynvml, handles[i], handles[j], direct.get(_normalize_bus_id(bus_ids[j]), 0), to_switch, levels
                    )
        return out, None
    except Exception as exc:
        return unknown, f"NVML query failed: {type(exc).__name__}: {exc}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _link_cell(pynvml, a, b, direct: int, to_switch: int, levels: dict[int, str]) -> str:
    """NV# for NVLink (direct, or through switches), else the PCIe path; '?' where NVML cannot tell."""
    if direct:
        return f"NV{direct}"
    try:
        nvlink = pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_NVLINK) == pynvml.NVML_P2P_STATUS_OK
    except pynvml.NVMLError:
        nvlink = False
    if nvlink:  # e.g. through NVSwitch, or a VM where per-link queries are not exposed
        return f"NV{to_switch}" if to_switch else "NV"
    try:
        level = pynvml.nvmlDeviceGetTopologyCommonAncestor(a, b)
    except pynvml.NVMLError:
        return "?"
    return levels.get(level, f"L{level}")


def _ipc_child(devices: list[int], requests, replies) -> None:
    """Second process: open the parent's buffers (CUDA IPC) and write into each from every GPU."""
    import torch

    errors: dict[str, str] = {}
    try:
        buffers = requests.get(timeout=60)
    except Exception as exc:  # opening the handles is what breaks in some containers
        replies.put({"open": f"{type(exc).__name__}: {exc}"})
        return
    for o, owned in enumerate(buffers):
        for u, user in enumerate(devices):
            try:
                owned[u : u + 1].copy_(torch.full((1,), 1000 * o + u + 1, dtype=torch.int32, device=f"cuda:{user}"))
            except Exception as exc:
                errors[f"{o},{u}"] = f"{type(exc).__name__}: {exc}"
    for d in devices:
        torch.cuda.synchronize(d)
    replies.put(errors)
    requests.get(timeout=60)  # keep the mappings until the parent has read the values


def _ipc_matrix(devices: list[int], timeout_s: float) -> tuple[list[list[str]], dict[str, str]]:
    import torch
    import torch.multiprocessing as mp

    n = len(devices)
    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    buffers = [torch.zeros(n, dtype=torch.int32, device=f"cuda:{d}") for d in devices]
    child = ctx.Process(target=_ipc_child, args=(devices, requests, replies), daemon=True)
    child.start()
    details: dict[str, str] = {}
    try:
        requests.put(buffers)
        try:
            errors = replies.get(timeout=timeout_s + 60)  # the child's own start (torch import) included
        except queue.Empty:
            return [["TIMEOUT"] * n for _ in range(n)], {"all": "the second process did not answer"}
        if "open" in errors:
            return [["FAIL"] * n for _ in range(n)], {"all": "opening IPC handles: " + errors["open"]}
        values = [b.tolist() for b in buffers]
        requests.put("done")
        out = []
        for o in range(n):
            row = []
            for u in range(n):
                key = f"{o},{u}"
                if key in errors:
                    row.append("ERROR")
                    details[key] = errors[key]
                elif values[o][u] == 1000 * o + u + 1:
                    row.append("OK")
                else:
                    row.append("FAIL")
                    details[key] = f"read {values[o][u]}, expected {1000 * o + u + 1}"
            out.append(row)
        return out, details
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()


def _bandwidth_gbps(src: int, dst: int, nbytes: int = 256 << 20) -> float:
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src}")
    b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst}")
    for _ in range(2):
        b.copy_(a)
    torch.cuda.synchronize(src)
    torch.cuda.synchronize(dst)
    with torch.cuda.device(src):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            b.copy_(a)
        end.record()
        end.synchronize()
    torch.cuda.synchronize(dst)
    return 5 * nbytes / (start.elapsed_time(end) * 1e-3) / 1e9


def recommend(report: dict) -> dict:
    """The backend `auto` would choose from a report's matrices, and why."""
    n = len(report["devices"])
    if n < 2:
        return {"backend": "p2p", "reason": "one GPU: no pair to check, nothing crosses a link"}
    m = report["matrices"]
    names = [d["index"] for d in report["devices"]]
    problems = []
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            pair = f"GPU {names[i]} -> {names[j]}"
            if m["peer_access"][i][j] != "Y":
                problems.append(f"{pair}: no peer access")
            elif m["native_atomics"][i][j] != "Y":
                problems.append(f"{pair}: no native P2P atomics")
            elif m["live_flag"][i][j] != "OK":
                problems.append(f"{pair}: live flag check {m['live_flag'][i][j]}")
            if m["ipc"][i][j] != "OK":
                problems.append(f"{pair}: CUDA IPC {m['ipc'][i][j]}")
    if not problems:
        return {
            "backend": "p2p",
            "reason": "every pair has peer access and native atomics, and passed the live flag check and CUDA IPC",
        }
    more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
    return {"backend": "nccl", "reason": "; ".join(problems[:3]) + more}


def gather(devices: list[int] | None = None, timeout_s: float = 2.0, bandwidth: bool = False) -> dict:
    """Runs every check and returns the report. Raises NoGPUError without a GPU, ValueError for bad devices."""
    from flashinfer_moe import __version__, sysinfo

    from .p2p_check import live_flag_check, pair_attributes, pci_bus_id, pingpong_latency_us

    try:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as exc:
        raise NoGPUError(f"CUDA is not usable: {exc}") from exc
    if count == 0:
        raise NoGPUError("no CUDA GPU is visible (no device, no driver, or CUDA_VISIBLE_DEVICES hides them)")
    if devices is None:
        devices = list(range(count))
    bad = [d for d in devices if not 0 <= d < count]
    if bad or len(set(devices)) != len(devices) or not devices:
        raise ValueError(f"devices must be distinct indices in 0..{count - 1}, got {devices}")
    if timeout_s <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout_s}")

    n = len(devices)
    bus_ids = [pci_bus_id(d) for d in devices]
    infos = []
    for d, bus in zip(devices, bus_ids, strict=True):
        p = torch.cuda.get_device_properties(d)
        infos.append({"index": d, "name": p.name, "pci_bus_id": bus, "compute_capability": f"{p.major}.{p.minor}"})

    def blank():
        return [["-" for _ in range(n)] for _ in range(n)]

    peer, atomics, live = blank(), blank(), blank()
    details: dict[str, str] = {}
    for i, a in enumerate(devices):
        for j, b in enumerate(devices):
            if i == j:
                continue
            attrs = pair_attributes(a, b)
            peer[i][j] = "Y" if attrs.can_access_peer else "N"
            atomics[i][j] = "Y" if attrs.native_atomics else "N"
            if attrs.can_access_peer:
                check = live_flag_check(a, b, timeout_s)
                live[i][j] = check.status
                details[f"live_flag {a}->{b}"] = check.detail
            else:
                live[i][j] = "SKIP"
    links, link_note = _link_matrix(devices, bus_ids)
    ipc, ipc_details = _ipc_matrix(devices, timeout_s)
    details.update({f"ipc {k}": v for k, v in ipc_details.items()})
    if link_note:
        details["link"] = link_note
    matrices = {"peer_access": peer, "link": links, "native_atomics": atomics, "live_flag": live, "ipc": ipc}
    if bandwidth:
        bw, lat = blank(), blank()
        for i, a in enumerate(devices):
            for j, b in enumerate(devices):
                if i != j and peer[i][j] == "Y":
                    bw[i][j] = f"{_bandwidth_gbps(a, b):.0f}"
                    if i < j:
                        us = pingpong_latency_us(a, b, timeout_s=timeout_s)
                        lat[i][j] = lat[j][i] = "TIMEOUT" if us is None else f"{us:.2f}"
        matrices["bandwidth_gbps"], matrices["latency_us"] = bw, lat
    report = {
        "schema_version": SCHEMA_VERSION,
        "header": {
            "flashinfer-moe": __version__,
            "driver": sysinfo.driver_versions(),
            "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
            "NCCL": sysinfo.nccl_library(),
            "GPUs": f"{n} probed of {count} visible",
            "timeout_s": timeout_s,
            "forced_failure": os.environ.get("FLASHINFER_MOE_PROBE_FORCE") or None,
        },
        "devices": infos,
        "matrices": matrices,
        "details": details,
    }
    report["recommendation"] = recommend(report)
    report["exit_code"] = EXIT_FIT if report["recommendation"]["backend"] == "p2p" else EXIT_UNFIT
    return report


def no_gpu_report(reason: str) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "error": reason,
        "devices": [],
        "matrices": {},
        "recommendation": {"backend": "nccl", "reason": f"no GPU: {reason}"},
        "exit_code": EXIT_NO_GPU,
    }


def format_matrix(title: str, labels: list[str], cells: list[list[str]]) -> str:
    width = max([len("D\\D")] + [len(x) for x in labels] + [len(c) for row in cells for c in row])
    lines = [title, "  ".join(s.ljust(width) for s in ["D\\D", *labels]).rstrip()]
    for label, row in zip(labels, cells, strict=True):
        lines.append("  ".join(s.ljust(width) for s in [label, *row]).rstrip())
    return "\n".join(lines)


def format_report(report: dict) -> str:
    """The human-readable report: a Key: value header, the matrices, the legend, and the choice last."""
    out = [f"{k}: {v}" for k, v in report["header"].items() if v is not None]
    for d in report["devices"]:
        out.append(f"GPU {d['index']}: {d['name']}, sm_{d['compute_capability'].replace('.', '')}, {d['pci_bus_id']}")
    labels = [str(d["index"]) for d in report["devices"]]
    for key, title in MATRICES:
        if key in report["matrices"]:
            out += ["", format_matrix(title, labels, report["matrices"][key])]
    out += ["", "Legend:"] + [f"  {k:<20} {v}" for k, v in LEGEND.items()]
    rec = report["recommendation"]
    out += ["", f"Recommended all-to-all backend: {rec['backend']} ({rec['reason']})"]
    return "\n".join(out)


def run(
    devices: list[int] | None, timeout_s: float, as_json: bool, bandwidth: bool, force: str | None = None
) -> tuple[int, str]:
    """The probe command's body: (exit code, text to print). Usage errors raise ValueError."""
    if force is not None:
        os.environ["FLASHINFER_MOE_PROBE_FORCE"] = force  # read by the live check, here and in any child
    start = time.monotonic()
    try:
        report = gather(devices, timeout_s, bandwidth)
    except NoGPUError as exc:
        report = no_gpu_report(str(exc))
        text = json.dumps(report, indent=1) if as_json else f"flashinfer-moe probe: {exc}"
        return EXIT_NO_GPU, text
    report["header"]["seconds"] = round(time.monotonic() - start, 1)
    return report["exit_code"], json.dumps(report, indent=1) if as_json else format_report(report)
