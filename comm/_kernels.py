"""The ``comm`` kernel family: the symmetric workspace helpers and the one-shot all-to-all kernels (JIT spec,
C signatures, and the parameter block the kernels take)."""

from __future__ import annotations

import ctypes

from flashinfer_moe._ops import check_launch, kernel_library
from flashinfer_moe.jit import KernelSpec, register

# sm_70: system-scope acquire/release (ld.acquire.sys, st.release.sys) and __nanosleep.
SPEC = register(KernelSpec("comm", ("comm/workspace.cu", "comm/a2a.cu", "comm/collective.cu"), min_arch="70"))

_vp, _int, _i64, _u64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_uint64
_pvp, _pi64, _pu64 = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(_i64), ctypes.POINTER(_u64)


class Params(ctypes.Structure):
    """Mirror of ``fim::a2a::Params`` in csrc/comm/a2a.cu (eight-byte fields first: no padding to guess)."""

    _fields_ = [
        ("peers", _vp),
        ("local", _vp),
        ("error", _vp),
        ("hidden_bytes", _i64),
        ("scale_bytes", _i64),
        ("row_stride", _i64),
        ("combine_stride", _i64),
        ("dispatch_off", _i64),
        ("combine_off", _i64),
        ("timeout_ns", _u64),
        ("rank", _int),
        ("world", _int),
        ("max_tokens", _int),
        ("top_k", _int),
        ("num_experts", _int),
        ("experts_per_rank", _int),
    ]


MAX_RANKS = 64  # fim::coll::kMaxRanks


def align16(n: int) -> int:
    """``n`` rounded up to 16 bytes: where the fields of a workspace record or a collective row start."""
    return (n + 15) // 16 * 16


class RowFormat(ctypes.Structure):
    """Mirror of ``fim::coll::Format`` in csrc/comm/collective.cu."""

    _fields_ = [
        ("row_bytes", _i64),
        ("hidden_bytes", _i64),
        ("ids_at", _i64),
        ("weights_at", _i64),
        ("scales_at", _i64),
        ("scale_bytes", _i64),
        ("top_k", _int),
    ]


class PackParams(ctypes.Structure):
    """Mirror of ``fim::coll::PackParams`` in csrc/comm/collective.cu."""

    _fields_ = [
        ("f", RowFormat),
        ("hidden", _vp),
        ("ids", _vp),
        ("weights", _vp),
        ("scales", _vp),
        ("send", _vp),
        ("slot", _vp),
        ("counts", _vp),
        ("offsets", _i64 * MAX_RANKS),
        ("num_tokens", _int),
        ("world", _int),
        ("num_experts", _int),
        ("experts_per_rank", _int),
        ("ids_64", _int),
        ("pad_to", _int),
        ("count_only", _int),
    ]


_P = ctypes.POINTER(Params)
_SIGNATURES = {
    "fim_ws_alloc": ([_int, _i64, _pvp], _int),
    "fim_ws_free": ([_int, _vp], _int),
    "fim_ws_ipc_handle": ([_vp, ctypes.c_char_p], _int),
    "fim_ws_ipc_open": ([_int, ctypes.c_char_p, _pvp], _int),
    "fim_ws_ipc_close": ([_int, _vp], _int),
    "fim_ws_fabric_supported": ([_int, ctypes.POINTER(_int)], _int),
    "fim_ws_fabric_alloc": ([_int, _i64, _pvp, _pi64, _pu64, ctypes.c_char_p], _int),
    "fim_ws_fabric_import": ([_int, ctypes.c_char_p, _i64, _pvp, _pu64], _int),
    "fim_ws_fabric_release": ([_int, _vp, _i64, _u64], _int),
    "fim_ws_host_alloc": ([_i64, _pvp], _int),
    "fim_ws_host_free": ([_vp], _int),
    "fim_ws_memset": ([_int, _vp, _int, _i64], _int),
    "fim_ws_copy": ([_int, _vp, _vp, _i64], _int),
    "fim_a2a_header_bytes": ([], _i64),
    "fim_a2a_max_ranks": ([], _int),
    "fim_a2a_preload": ([], _int),
    "fim_a2a_dispatch_send": ([_P, _vp, _vp, _vp, _int, _vp, _int, _int, _vp, _int, _vp], _int),
    "fim_a2a_dispatch_wait": ([_P, _vp, _vp], _int),
    "fim_a2a_dispatch_recv": (
        [_P, _int, _int, _i64, _int, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _int, _vp],
        _int,
    ),
    "fim_a2a_combine_send": ([_P, _vp, _i64, _vp, _vp, _i64, _int, _int, _vp], _int),
    "fim_a2a_combine_recv": ([_P, _int, _vp, _int, _int, _int, _vp, _int, _vp], _int),
    "fim_a2a_handshake": ([_P, _u64, _int, _vp, _vp], _int),
    "fim_coll_pack": ([ctypes.POINTER(PackParams), _int, _vp], _int),
    "fim_coll_unpack": (
        [ctypes.POINTER(RowFormat), _vp, _i64, _int, _int, _vp, _vp, _vp, _vp, _vp, _int, _vp],
        _int,
    ),
    "fim_coll_combine": ([_int, _vp, _vp, _pi64, _int, _int, _int, _vp, _int, _vp], _int),
}

HANDLE_BYTES = 64  # cudaIpcMemHandle_t and CUmemFabricHandle alike


def comm_lib() -> ctypes.CDLL:
    return kernel_library("comm", _SIGNATURES)


def check(status: int, what: str) -> None:
    check_launch(comm_lib(), status, what)


def error_text(status: int) -> str:
    return comm_lib().fim_error_string(status).decode(errors="replace")
