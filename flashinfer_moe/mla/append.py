"""Writing new tokens' latent and rope rows into a paged MLA cache (``mla_append_kv``), quantizing to FP8 where
the cache holds FP8 pages, optionally rotating the rope rows on the way.

Layouts (SGLang's and FlashMLA's): one tensor `[P, page, 576]` per layer, each token's 512 latent channels
then its 64 rope channels; or two, `[P, page, 512]` latent and `[P, page, 64]` rope. Token ``offset`` of page
``p`` is slot ``p * page + offset``.

Rope: with ``positions`` and ``cos_sin_cache`` the rope rows arrive unrotated and the same kernel rotates them
(in fp64, where the fp32 products are exact, then rounded to fp32 and converted to the cache's type like a
rotated fp32 row), instead of a rope kernel writing rotated rows that the append reads back. The saving is
that kernel's launch and a write and a read of `[N, 64]` elements (and, with FP8 pages, the intermediate
rounding to the source type), against a gathered cos/sin row per token inside the append;
``launch/bench_mla_prefill.py --append-only`` times both paths (a plain-torch rope then the append, and the
fused call), measured in docs/perf.md. A model whose rope kernel rotates the queries and keys together keeps
that kernel for the queries, so there the saving is the key rows' share of its traffic, not a launch.
"""

from __future__ import annotations

import ctypes

import torch

from flashinfer_moe import _checks
from flashinfer_moe import reference_mla as ref
from flashinfer_moe._ops import DTYPE_CODES, LIB, check_launch, kernel_library, on_device, stream_of
from flashinfer_moe.jit import KernelSpec, register
from flashinfer_moe.moe.quant import scale_tensor

__all__ = ["PAGE_SIZES", "mla_append_kv"]

# sm_80 like the other families (bf16 conversions are native from there; E4M3 ones are emulated below sm_89).
MLA_APPEND_SPEC = register(KernelSpec("mla_append", ("mla/mla_append.cu",), min_arch="80"))

FP8 = torch.float8_e4m3fn
PAGE_SIZES = (1, 16, 32, 64, 128)
CACHE_DTYPES = (torch.bfloat16, torch.float16, FP8)
SOURCE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FP8_CODE = 3  # csrc/mla/mla_append.cu's code for E4M3 pages

_vp, _i64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "fim_mla_append": (
        [_vp, _vp, _int, _i64, _i64, _vp, _int, _i64, _vp, _int, _i64, _i64, _vp, _int, _i64, _i64, _i64, _i64]
        + [_vp, _int]
        + [_vp, _int, _vp, _int, _i64, _i64, _int, _vp],
        _int,
    ),
}

LIB.define(
    "mla_append_kv_(Tensor ckv, Tensor kpe, Tensor slots, Tensor(a!) kv_cache, Tensor(b!)? kpe_cache, "
    "Tensor? kv_scale, Tensor? positions=None, Tensor? cos_sin_cache=None, bool rope_interleaved=True) -> ()"
)


def _append_cpu(ckv, kpe, slots, kv_cache, kpe_cache, kv_scale, positions=None, cos_sin_cache=None, interleaved=True):
    if cos_sin_cache is None:
        ref.append_kv(ckv, kpe, slots, kv_cache, kpe_cache, kv_scale)
    else:
        ref.append_kv_rope(ckv, kpe, slots, kv_cache, positions, cos_sin_cache, interleaved, kpe_cache, kv_scale)


def _code(dtype: torch.dtype) -> int:
    return _FP8_CODE if dtype == FP8 else DTYPE_CODES[dtype]


def _aligned(*parts: tuple[torch.Tensor, tuple[int, ...]]) -> bool:
    """Every tensor starts on a 16-byte boundary and every listed stride (elements) spans whole 16 bytes."""
    return all(t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in strides) for t, strides in parts)


def _append_cuda(ckv, kpe, slots, kv_cache, kpe_cache, kv_scale, positions=None, cos_sin_cache=None, interleaved=True):
    lib = kernel_library("mla_append", _SIGNATURES)
    num_pages, page_size = kv_cache.shape[:2]
    if kpe_cache is None:
        rope, rope_strides = kv_cache[..., ref.LATENT :], kv_cache.stride()[:2]
    else:
        rope, rope_strides = kpe_cache, kpe_cache.stride()[:2]
    vec = _aligned(
        (ckv, (ckv.stride(0),)),
        (kpe, (kpe.stride(0),)),
        (kv_cache, kv_cache.stride()[:2]),
        (rope, rope_strides),
    )
    rotating = cos_sin_cache is not None
    with on_device(ckv):
        status = lib.fim_mla_append(
            ckv.data_ptr(),
            kpe.data_ptr(),
            DTYPE_CODES[ckv.dtype],
            ckv.stride(0),
            kpe.stride(0),
            slots.data_ptr(),
            int(slots.dtype == torch.int64),
            ckv.shape[0],
            kv_cache.data_ptr(),
            _code(kv_cache.dtype),
            kv_cache.stride(0),
            kv_cache.stride(1),
            rope.data_ptr(),
            _code(rope.dtype),
            rope_strides[0],
            rope_strides[1],
            num_pages,
            page_size,
            None if kv_scale is None else kv_scale.data_ptr(),
            int(vec),
            positions.data_ptr() if rotating else None,
            int(rotating and positions.dtype == torch.int64),
            cos_sin_cache.data_ptr() if rotating else None,
            DTYPE_CODES[cos_sin_cache.dtype] if rotating else 0,
            cos_sin_cache.stride(0) if rotating else 0,
            cos_sin_cache.shape[0] if rotating else 0,
            int(interleaved),
            stream_of(ckv),
        )
    check_launch(lib, status, "mla_append_kv")


LIB.impl("mla_append_kv_", _append_cpu, "CPU")
LIB.impl("mla_append_kv_", _append_cuda, "CUDA")
torch.library.register_fake("flashinfer_moe::mla_append_kv_", lambda *args: None, lib=LIB)


def _rows(name: str, x: object, width: int) -> torch.Tensor:
    x = _checks.tensor(name, x)
    _checks.dtype_in(name, x, SOURCE_DTYPES)
    if x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"{name} must have shape [N, {width}], got {tuple(x.shape)}")
    _checks.unit_last_stride(name, x)
    return x


def check_cache(kv_cache: object, kpe_cache: object = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A paged latent cache in either layout: dtype, shape, page size and unit channel stride checked."""
    kv_cache = _checks.tensor("kv_cache", kv_cache)
    _checks.dtype_in("kv_cache", kv_cache, CACHE_DTYPES)
    width = ref.LATENT + ref.ROPE if kpe_cache is None else ref.LATENT
    if kv_cache.dim() != 3 or kv_cache.shape[2] != width:
        raise ValueError(f"kv_cache must have shape [P, page, {width}], got {tuple(kv_cache.shape)}")
    if kv_cache.shape[1] not in PAGE_SIZES:
        raise ValueError(f"kv_cache must have a page size (dim 1) in {PAGE_SIZES}, got {kv_cache.shape[1]}")
    _checks.unit_last_stride("kv_cache", kv_cache)
    if kpe_cache is not None:
        kpe_cache = _checks.tensor("kpe_cache", kpe_cache)
        rope_dtypes = CACHE_DTYPES if kv_cache.dtype == FP8 else (kv_cache.dtype,)
        _checks.dtype_in("kpe_cache", kpe_cache, rope_dtypes)
        expected = (*kv_cache.shape[:2], ref.ROPE)
        if tuple(kpe_cache.shape) != expected:
            raise ValueError(f"kpe_cache must have shape {expected} (kv_cache's pages), got {tuple(kpe_cache.shape)}")
        _checks.same_device("kpe_cache", kpe_cache, "kv_cache", kv_cache)
        _checks.unit_last_stride("kpe_cache", kpe_cache)
    return kv_cache, kpe_cache


def cache_scale(kv_scale: object, kv_cache: torch.Tensor, kpe_cache: torch.Tensor | None) -> torch.Tensor | None:
    """``kv_scale`` as a 0-d float32 tensor on the cache's device: required with FP8 pages, refused without."""
    fp8 = kv_cache.dtype == FP8 or (kpe_cache is not None and kpe_cache.dtype == FP8)
    if not fp8:
        if kv_scale is not None:
            raise ValueError(f"kv_scale is only for float8_e4m3fn caches, got one with a {kv_cache.dtype} cache")
        return None
    if kv_scale is None:
        raise ValueError("kv_scale must be given for a float8_e4m3fn cache (real = stored * kv_scale), got None")
    return scale_tensor("kv_scale", kv_scale, "kv_cache", kv_cache)


def mla_append_kv(
    ckv: torch.Tensor,
    kpe: torch.Tensor,
    slots: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    kpe_cache: torch.Tensor | None = None,
    kv_scale: torch.Tensor | float | None = None,
    positions: torch.Tensor | None = None,
    cos_sin_cache: torch.Tensor | None = None,
    rope_interleaved: bool = True,
) -> None:
    """Writes ``N`` new tokens' latent and rope rows into their cache slots, in place; the rope rows either
    already rotated, or rotated here by ``positions`` and ``cos_sin_cache``.

    Values are converted to the cache's type with round-to-nearest-even (torch's ``.to``); FP8 pages store
    ``e4m3(x * (1 / kv_scale))`` with the reciprocal correctly rounded and saturation at +-448 (where
    ``.to(float8_e4m3fn)`` alone would give NaN), the definition of ``quantize_fp8_per_tensor``. In the two-tensor
    layout the rope part may stay bf16/fp16 beside FP8 latent pages; an FP8 rope part shares ``kv_scale``.

    Slots: a negative slot (padding) is skipped. A slot past the cache (``>= P * page``) cannot be reported on a
    GPU without a host sync: it is skipped there too (nothing is written outside the cache); on CPU tensors it
    raises. Two tokens with the same slot leave one of them, unspecified which. One kernel launch, no
    allocation (with ``kv_scale`` a tensor; a Python number is copied to the device per call), capturable.

    Rope: with ``positions`` and ``cos_sin_cache`` (both or neither), ``kpe`` holds unrotated rows and each pair
    ``(a, b)`` at frequency ``i`` is stored as ``(a cos - b sin, b cos + a sin)``, ``cos, sin =
    cos_sin_cache[pos, i], cos_sin_cache[pos, 32 + i]``: formed in float64 (the products are exact, the sum
    rounded once), rounded to float32 and converted as above, so the cache sees one rounding from a float32
    row, never the source type's (bit-exact with the CPU reference). A position
    outside ``[0, max_pos)`` is handled like a slot past the cache: on a GPU the token is not written at all
    (its slot keeps what it held); on CPU tensors it raises. Padding tokens' (negative slot) positions are
    never read.

    Args:
        ckv: `[N, 512]` float32/float16/bfloat16 latent rows (unit channel stride, any row stride).
        kpe: `[N, 64]` rope rows, ``ckv``'s dtype.
        slots: `[N]` int64 (or int32) ``page * page_size + offset``.
        kv_cache: `[P, page, 576]` bfloat16/float16/float8_e4m3fn, or `[P, page, 512]` with ``kpe_cache``;
            page size 1, 16, 32, 64 or 128; any page and token strides, unit channel stride.
        kpe_cache: `[P, page, 64]`, ``kv_cache``'s dtype, or bfloat16/float16 beside FP8 ``kv_cache``.
        kv_scale: the dequantization scale of FP8 pages (real = stored * kv_scale): a positive float or a
            one-element float32 tensor; required with FP8 pages, refused without.
        positions: `[N]` int64 (or int32) position of each token, the row of ``cos_sin_cache`` it takes.
        cos_sin_cache: `[max_pos, 64]` float32/bfloat16/float16, 32 cosines then 32 sines per position
            (unit column stride, any row stride).
        rope_interleaved: rotate the pairs ``(x[2i], x[2i + 1])`` (GPT-J style, DeepSeek-V3's); False: the
            halves ``(x[i], x[i + 32])`` (GPT-NeoX style).
    """
    ckv = _rows("ckv", ckv, ref.LATENT)
    kpe = _rows("kpe", kpe, ref.ROPE)
    if kpe.dtype != ckv.dtype:
        raise TypeError(f"kpe must have ckv's dtype ({ckv.dtype}), got {kpe.dtype}")
    _checks.same_device("kpe", kpe, "ckv", ckv)
    if kpe.shape[0] != ckv.shape[0]:
        raise ValueError(f"kpe must have ckv's {ckv.shape[0]} rows, got shape {tuple(kpe.shape)}")
    slots = _checks.tensor("slots", slots)
    _checks.dtype_in("slots", slots, (torch.int64, torch.int32))
    if tuple(slots.shape) != (ckv.shape[0],):
        raise ValueError(f"slots must have shape [N] = ({ckv.shape[0]},), got {tuple(slots.shape)}")
    _checks.same_device("slots", slots, "ckv", ckv)
    kv_cache, kpe_cache = check_cache(kv_cache, kpe_cache)
    _checks.same_device("kv_cache", kv_cache, "ckv", ckv)
    scale = cache_scale(kv_scale, kv_cache, kpe_cache)
    capacity = kv_cache.shape[0] * kv_cache.shape[1]
    if slots.device.type == "cpu" and slots.numel() and int(slots.max()) >= capacity:
        raise ValueError(f"slots must be < P * page = {capacity} (negative to skip), got {int(slots.max())}")
    if (positions is None) != (cos_sin_cache is None):
        given, missing = ("positions", "cos_sin_cache") if cos_sin_cache is None else ("cos_sin_cache", "positions")
        raise ValueError(f"positions and cos_sin_cache must be given together, got {given} without {missing}")
    if positions is not None:
        positions, cos_sin_cache = _check_rope(positions, cos_sin_cache, rope_interleaved, ckv, slots)
    if ckv.shape[0] and capacity:
        torch.ops.flashinfer_moe.mla_append_kv_(
            ckv, kpe, slots.contiguous(), kv_cache, kpe_cache, scale, positions, cos_sin_cache, rope_interleaved
        )


def _check_rope(
    positions: object, cos_sin_cache: object, interleaved: object, ckv: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    positions = _checks.tensor("positions", positions)
    _checks.dtype_in("positions", positions, (torch.int64, torch.int32))
    if tuple(positions.shape) != (ckv.shape[0],):
        raise ValueError(f"positions must have shape [N] = ({ckv.shape[0]},), got {tuple(positions.shape)}")
    _checks.same_device("positions", positions, "ckv", ckv)
    cos_sin_cache = _checks.tensor("cos_sin_cache", cos_sin_cache)
    _checks.dtype_in("cos_sin_cache", cos_sin_cache, SOURCE_DTYPES)
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != ref.ROPE:
        raise ValueError(f"cos_sin_cache must have shape [max_pos, {ref.ROPE}], got {tuple(cos_sin_cache.shape)}")
    _checks.unit_last_stride("cos_sin_cache", cos_sin_cache)
    _checks.same_device("cos_sin_cache", cos_sin_cache, "ckv", ckv)
    if not isinstance(interleaved, bool):
        raise TypeError(f"rope_interleaved must be a bool, got {type(interleaved).__name__}")
    if positions.device.type == "cpu":
        used = positions[slots >= 0]
        max_pos = cos_sin_cache.shape[0]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= max_pos):
            bad = int(used.min()) if int(used.min()) < 0 else int(used.max())
            raise ValueError(
                f"positions must be in [0, max_pos = {max_pos}) (cos_sin_cache's rows) where slots >= 0, got {bad}"
            )
    return positions.contiguous(), cos_sin_cache
