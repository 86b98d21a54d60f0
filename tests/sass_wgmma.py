"""Static check of sm_90a SASS: no instruction touches the registers of a wgmma (``HGMMA``; ``QGMMA`` for FP8) still in
flight.

An ``HGMMA`` with its left operand in registers (``HGMMA.64x256x16.F32.BF16 R24, R152, gdesc[...], R24``) reads
R152..R155 after it issues, and writes its accumulators R24.. until a ``WARPGROUP.DEPBAR.LE gsb0, N`` leaves at
most N commit groups in flight (a group ends at the ``HGMMA`` marked ``gsb0``). Writing the operand registers or
touching the accumulators before that is undefined in PTX, and ptxas does not always stop it: Triton 3.6's
pipelined register-operand dots let the next K step's code write the operands of the step's last products
(triton-lang/triton#9433), which gave wrong outputs on an H200.

:func:`hazards` walks each function's instructions in order, and each loop (a backward branch) a second time
with the groups its first pass left in flight, and returns every instruction that writes an in-flight group's
operand registers or reads or writes its accumulators. Predicated instructions count (a write that may happen
is a hazard). Registers are taken from the instruction text: a destination's width from the opcode's ``.64`` /
``.128`` / ``.WIDE``, sources as named (the second register of a 64-bit source is not counted)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_HGMMA = re.compile(r"[HQ]GMMA\.64x(\d+)x\d+\.(F32|F16)\S*\s+R(\d+),\s*(R\d+|gdesc)")
_DEPBAR = re.compile(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)")
_BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
_REG = re.compile(r"(?<![A-Z_.])R(\d+)\b")
# Opcodes whose first register is read, not written (uniform-datapath ones, U..., all are: see _dest).
_NO_DEST = (
    "ST",
    "RED",
    "ATOM",
    "BAR",
    "BRA",
    "SYNCS",
    "WARPGROUP",
    "MEMBAR",
    "FENCE",
    "EXIT",
    "RET",
    "CALL",
    "DEPBAR",
    "CCTL",
    "NOP",
    "ISETP",
    "FSETP",
    "HSETP",
    "DSETP",
    "PLOP3",
    "VOTE",
    "ELECT",
    "WARPSYNC",
    "BSYNC",
    "BSSY",
    "ERRBAR",
    "R2UR",
    "REDUX",
)


def _split(text: str) -> tuple[str, str]:
    body = re.sub(r"^@!?U?P[T0-9]+\s+", "", text)
    op, _, rest = body.partition(" ")
    return op, rest


def _dest(op: str, rest: str) -> set[int]:
    if op.startswith(_NO_DEST) or op.startswith("U"):
        return set()
    m = re.match(r"\s*R(\d+)\b", rest)
    if not m:
        return set()
    width = 4 if ".128" in op else 2 if (".64" in op or ".WIDE" in op) else 1
    if op.startswith("LDSM"):
        width = 4 if ".4" in op else 2 if ".2" in op else 1
    return set(range(int(m.group(1)), int(m.group(1)) + width))


def _all_regs(rest: str) -> set[int]:
    return {int(r) for r in _REG.findall(rest)}


def _functions(sass: str) -> list[tuple[str, list[tuple[int, str]]]]:
    parts = re.split(r"\n\s*Function : (\S+)", sass)
    return [(parts[i], [(int(a, 16), t) for a, t in _INSTR.findall(parts[i + 1])]) for i in range(1, len(parts), 2)]


def _walk(body, groups, hazards, report: bool):
    """One pass over ``body`` with ``groups`` (a list of (operand registers, accumulators) per commit group, the
    open one last) in flight; returns the groups in flight after it."""
    open_group: tuple[set[int], set[int]] | None = None
    for addr, text in body:
        op, rest = _split(text)
        m = _HGMMA.search(text)
        if m:
            n, acc_type, d0, a = int(m.group(1)), m.group(2), int(m.group(3)), m.group(4)
            acc = set(range(d0, d0 + (n // 2 if acc_type == "F32" else n // 4)))
            operand = set(range(int(a[1:]), int(a[1:]) + 4)) if a.startswith("R") else set()
            if open_group is None:
                open_group = (set(), set())
            open_group[0].update(operand)
            open_group[1].update(acc)
            if "gsb0" in text:
                groups = groups + [open_group]
                open_group = None
            continue
        d = _DEPBAR.search(text)
        if d:
            keep = int(d.group(1), 16)
            groups = groups[max(0, len(groups) - keep) :]
            continue
        if not report:
            continue
        written, touched = _dest(op, rest), _all_regs(rest)
        for operand, acc in groups + ([open_group] if open_group else []):
            if written & operand or touched & acc:
                hazards.append((addr, text))
                break
    if open_group is not None:
        groups = groups + [open_group]
    return groups


def hazards(sass: str) -> list[tuple[str, int, str]]:
    """``(function, address, instruction)`` of every access to an in-flight wgmma's registers in ``sass`` (the
    text ``cuobjdump -sass`` prints)."""
    found = []
    for name, instrs in _functions(sass):
        if not any("GMMA" in t for _, t in instrs):
            continue
        local: list[tuple[int, str]] = []
        _walk(instrs, [], local, report=True)
        index = {a: i for i, (a, _) in enumerate(instrs)}
        for i, (addr, text) in enumerate(instrs):
            b = _BRANCH.search(text)
            if not b or int(b.group(1), 16) >= addr or int(b.group(1), 16) not in index:
                continue
            loop = instrs[index[int(b.group(1), 16)] : i + 1]
            if any("GMMA" in t for _, t in loop):
                _walk(loop, _walk(loop, [], [], report=False), local, report=True)
        found.extend((name, a, t) for a, t in sorted(set(local)))
    return found


def cuobjdump() -> str | None:
    """Triton's bundled ``cuobjdump``, else the one on PATH."""
    try:
        import triton

        path = Path(triton.knobs.nvidia.cuobjdump.path)
        if path.exists():
            return str(path)
    except Exception:  # noqa: BLE001 (an old or absent Triton: look on PATH)
        pass
    return shutil.which("cuobjdump")


def sass_of(cubin: Path) -> str:
    return subprocess.run([cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
