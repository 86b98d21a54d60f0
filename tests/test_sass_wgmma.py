"""``sass_wgmma.hazards`` on hand-written SASS: it finds writes to an in-flight wgmma's register operand and
accesses to its accumulators, in straight code and across a loop's back edge, and nothing once a
``WARPGROUP.DEPBAR`` has retired the group."""

import pytest
import sass_wgmma


def _sass(*lines: str) -> str:
    body = "\n".join(f"        /*{16 * i:04x}*/                   {text} ;" for i, text in enumerate(lines))
    return f"\n\tFunction : k\n{body}\n"


LOOP_TOP = "VIADD R10, R10, 0x1"
EXPAND = "LOP3.LUT R152, R14, 0x81c081c0, RZ, 0xc0, !PT"  # writes the first operand's register
GEMM1 = "HGMMA.64x256x16.F32.BF16 R24, R152, gdesc[UR12], R24, gsb0"
GEMM2 = "HGMMA.64x256x16.F32.BF16 R24, R156, gdesc[UR12], R24, gsb0"


def test_write_before_the_wait_is_found():
    found = sass_wgmma.hazards(_sass(GEMM1, "IMAD R153, R1, 0x2, RZ", "WARPGROUP.DEPBAR.LE gsb0, 0x0"))
    assert [t for _, _, t in found] == ["IMAD R153, R1, 0x2, RZ"]


def test_fp8_wgmma_operand_write_is_found():
    # W4A8's e4m3 products (QGMMA) read their register operand the same way.
    qgmma = "QGMMA.64x128x32.F32.E4M3.E4M3 R24, R100, gdesc[UR12], R24, gsb0"
    found = sass_wgmma.hazards(
        _sass(qgmma, "PRMT R102, R3, 0x5410, R4", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "MOV R100, RZ")
    )
    assert [t for _, _, t in found] == ["PRMT R102, R3, 0x5410, R4"]


def test_write_after_the_wait_is_not():
    assert not sass_wgmma.hazards(_sass(GEMM1, "WARPGROUP.DEPBAR.LE gsb0, 0x0", "IMAD R153, R1, 0x2, RZ"))


def test_a_wait_that_leaves_the_group_in_flight_does_not_retire_it():
    # Two groups, at most one left in flight: the second (R156..R159) may still be reading.
    found = sass_wgmma.hazards(_sass(GEMM1, GEMM2, "WARPGROUP.DEPBAR.LE gsb0, 0x1", "MOV R157, RZ", "MOV R152, RZ"))
    assert [t for _, _, t in found] == ["MOV R157, RZ"]


def test_accumulator_read_before_the_wait_is_found():
    found = sass_wgmma.hazards(_sass(GEMM1, "FMUL R30, R30, 0.5", "WARPGROUP.DEPBAR.LE gsb0, 0x0"))
    assert [t for _, _, t in found] == ["FMUL R30, R30, 0.5"]


@pytest.mark.parametrize("keep, racy", [(1, True), (0, False)])
def test_loop_back_edge(keep, racy):
    # The loop's top writes the operand that the previous iteration's wgmma, left in flight, still reads.
    sass = _sass(LOOP_TOP, EXPAND, GEMM1, f"WARPGROUP.DEPBAR.LE gsb0, 0x{keep}", "@!P0 BRA 0x0", "EXIT")
    found = sass_wgmma.hazards(sass)
    assert bool(found) == racy, found
    if racy:
        assert found[0][2] == EXPAND


def test_groups_close_at_gsb0():
    # Three wgmma in one commit group (gsb0 on the last): a wait for zero retires all of them.
    sass = _sass(
        "HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR4], R24",
        "HGMMA.64x128x16.F32.BF16 R24, R156, gdesc[UR4], R24",
        "HGMMA.64x128x16.F32.BF16 R24, R160, gdesc[UR4], R24, gsb0",
        "MOV R161, RZ",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",
        "MOV R153, RZ",
    )
    assert [t for _, _, t in sass_wgmma.hazards(sass)] == ["MOV R161, RZ"]


def test_shared_memory_operands_have_no_register_operand():
    sass = _sass("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24, gsb0", "MOV R152, RZ", "FADD R30, R30, 1")
    assert [t for _, _, t in sass_wgmma.hazards(sass)] == ["FADD R30, R30, 1"]
