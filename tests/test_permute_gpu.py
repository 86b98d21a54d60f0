"""GPU tier for layouts, permute, quantizers and combine (pytest -m gpu): every kernel bit for bit against the
reference run on the CPU, on fresh random inputs, with output buffers poisoned before each call.

Rows of a layout that hold no pair are left unwritten by the kernels: they must still hold the poison.
"""

import pytest
import torch
from checks import bits

import flashinfer_moe as fm
from flashinfer_moe import reference as ref

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn
FLOATS = [torch.float32, torch.bfloat16, torch.float16]


def make_ids(g, num_tokens, top_k, num_experts, kind, dtype=torch.int32):
    """Routing ids: distinct experts per token; "holes": ids -1 and experts that receive nothing; "one": all
    pairs to the last expert (ids repeat within a token, as a stress of the ranks)."""
    if kind == "one":
        return torch.full((num_tokens, top_k), num_experts - 1, dtype=dtype)
    ids = torch.rand(num_tokens, num_experts, generator=g).argsort(-1)[:, :top_k]
    if kind == "holes":
        ids = torch.where(ids % 3 == 0, -1, ids)
    elif kind == "skewed":  # a quarter of the experts get almost everything
        ids = torch.where(torch.rand(num_tokens, top_k, generator=g) < 0.9, ids % max(num_experts // 4, 1), ids)
    return ids.to(dtype)


def randn(g, *shape, dtype=torch.float32, spread=2.0):
    # Rows of very different magnitudes, so that scales differ from row to row and group to group.
    x = torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape[:-1], 1, generator=g) * spread)
    return x.to(dtype)


def poisoned(shape, dtype):
    t = torch.empty(shape, dtype=dtype, device="cuda")
    if t.element_size() == 1:
        t.view(torch.uint8).fill_(0xA5)
    else:
        t.fill_(float("nan"))
    return t


def assert_layout_equal(got, want, seed):
    for name in ("tokens_per_expert", "expert_offsets", "row_of", "source_of", "status"):
        a, b = getattr(got, name).cpu(), getattr(want, name)
        assert torch.equal(a, b), f"seed {seed}: {name} differs, first at {(a != b).nonzero()[:3].tolist()}"
    assert (got.kind, got.num_rows, got.rows_shape) == (want.kind, want.num_rows, want.rows_shape)


def assert_rows(got, want, layout, poison, seed, what):
    """Owned rows equal the reference bit for bit; with a poison, the others must still hold it."""
    owned = layout.source_of.cpu() >= 0
    got_rows = bits(got).reshape(layout.num_rows, -1)
    want_rows = bits(want).reshape(layout.num_rows, -1)
    diff = (got_rows[owned] != want_rows[owned]).any(-1).nonzero().flatten()
    assert diff.numel() == 0, f"seed {seed}: {what}: {diff.numel()} owned rows differ, first {diff[:4].tolist()}"
    if poison is not None:
        # Compared as raw bits (uint8 or float), NaN poison included.
        got_raw, poison_raw = got_rows[~owned], bits(poison).reshape(layout.num_rows, -1)[~owned]
        same = (got_raw == poison_raw) | (
            got_raw.isnan() & poison_raw.isnan() if got_raw.is_floating_point() else False
        )
        assert same.all(), f"seed {seed}: {what}: a row that holds no pair was written"


def cpu_layout(layout, ids):
    """The reference's version of a GPU layout, built from the same ids on the CPU."""
    if layout.kind == "contiguous":
        return ref.moe_align_contiguous(ids.cpu(), layout.num_experts, layout.block_rows)
    return ref.moe_align_masked(ids.cpu(), layout.num_experts, layout.capacity)


# ---------------------------------------------------------------------------------------------- layouts

ALIGN_SHAPES = [(1, 1, 8), (3, 2, 8), (7, 8, 256), (128, 8, 256), (1000, 6, 64), (4096, 8, 256), (65536, 8, 256)]
ALIGN_SHAPES += [(1000, 8, 1024), (2049, 8, 384), (512, 4, 1)]


@pytest.mark.parametrize("num_tokens, top_k, num_experts", ALIGN_SHAPES)
@pytest.mark.parametrize("kind", ["spread", "holes", "skewed", "one"])
def test_align_contiguous_matches_reference(num_tokens, top_k, num_experts, kind, generator):
    ids = make_ids(generator, num_tokens, top_k, num_experts, kind)
    for block_rows, dtype in ((1, torch.int32), (128, torch.int64), (16, torch.int32)):
        got = fm.moe_align_contiguous(ids.to(dtype).cuda(), num_experts, block_rows)
        assert_layout_equal(got, ref.moe_align_contiguous(ids, num_experts, block_rows), generator.initial_seed())


@pytest.mark.parametrize("num_tokens, top_k, num_experts", ALIGN_SHAPES)
@pytest.mark.parametrize("kind", ["holes", "skewed", "one"])
def test_align_masked_matches_reference(num_tokens, top_k, num_experts, kind, generator):
    ids = make_ids(generator, num_tokens, top_k, num_experts, kind)
    fair = -(-num_tokens * top_k // num_experts)
    for capacity in (0, 1, max(1, fair // 2), 2 * fair):  # overflow in all but the last
        got = fm.moe_align_masked(ids.cuda(), num_experts, capacity)
        assert_layout_equal(got, ref.moe_align_masked(ids, num_experts, capacity), generator.initial_seed())


def test_align_bad_ids_raise_or_are_counted(generator):
    ids = make_ids(generator, 300, 4, 16, "spread")
    ids[5, 1], ids[200, 3], ids[7, 0] = 16, -2, 1 << 20
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[-1, num_experts\).*got 3 ids"):
        fm.moe_align_contiguous(ids.cuda(), 16)
    layout = fm.moe_align_masked(ids.cuda(), 16, 1000, validate=False)  # dropped and counted, never written
    assert layout.status.tolist() == [0, 3]
    assert (layout.row_of[5, 1], layout.row_of[200, 3], layout.row_of[7, 0]) == (-1, -1, -1)
    clean = torch.where((ids < -1) | (ids >= 16), -1, ids)
    want = ref.moe_align_masked(clean, 16, 1000)
    assert torch.equal(layout.row_of.cpu(), want.row_of) and torch.equal(layout.source_of.cpu(), want.source_of)


# ---------------------------------------------------------------------------------------------- permute


def _layouts(ids, num_experts):
    yield "contiguous", fm.moe_align_contiguous(ids.cuda(), num_experts, 128)
    yield "masked", fm.moe_align_masked(ids.cuda(), num_experts, max(1, ids.numel() // num_experts))


PERMUTE_SHAPES = [(1, 1, 8, 128), (3, 2, 4, 384), (1000, 8, 64, 2048), (257, 6, 32, 7168)]


@pytest.mark.parametrize("num_tokens, top_k, num_experts, hidden_size", PERMUTE_SHAPES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_permute_quantized_matches_reference(num_tokens, top_k, num_experts, hidden_size, dtype, generator):
    seed = generator.initial_seed()
    ids = make_ids(generator, num_tokens, top_k, num_experts, "holes")
    x = randn(generator, num_tokens, hidden_size, dtype=dtype)
    scale = torch.tensor(x.float().abs().max().item() / 300)  # some values saturate at 448
    for name, layout in _layouts(ids, num_experts):
        cpu = cpu_layout(layout, ids)
        rows = (*layout.rows_shape, hidden_size)
        for group, pow2 in ((128, False), (128, True), (32, False)):
            out = (poisoned(rows, FP8), poisoned((*layout.rows_shape, hidden_size // group), torch.float32))
            poison = tuple(t.clone() for t in out)
            q, s = fm.permute_fp8_per_token_group(x.cuda(), layout, group_size=group, scale_pow2=pow2, out=out)
            q_ref, s_ref = ref.permute_fp8_per_token_group(x, cpu, group, pow2)
            assert_rows(q, q_ref, layout, poison[0], seed, f"{name} fp8 group {group} pow2={pow2} q")
            assert_rows(s, s_ref, layout, poison[1], seed, f"{name} fp8 group {group} pow2={pow2} scales")
        for given in (scale.cuda(), None):
            out = poisoned(rows, FP8)
            poison = out.clone()
            q, s = fm.permute_fp8_per_tensor(x.cuda(), layout, given, out=out)
            q_ref, s_ref = ref.permute_fp8_per_tensor(x, cpu, None if given is None else scale)
            assert torch.equal(s.cpu(), s_ref), f"seed {seed}: per-tensor scale {s.item()} vs {s_ref.item()}"
            assert_rows(q, q_ref, layout, poison, seed, f"{name} fp8 tensor given={given is not None}")
        for given in (torch.tensor(scale.item() / 6), None):
            out = (
                poisoned((*layout.rows_shape, hidden_size // 2), torch.uint8),
                poisoned((*layout.rows_shape, hidden_size // 16), FP8),
            )
            poison = tuple(t.clone() for t in out)
            p, bs, gs = fm.permute_nvfp4(x.cuda(), layout, None if given is None else given.cuda(), out=out)
            p_ref, bs_ref, gs_ref = ref.permute_nvfp4(x, cpu, given)
            assert torch.equal(gs.cpu(), gs_ref), f"seed {seed}: nvfp4 global scale"
            assert_rows(p, p_ref, layout, poison[0], seed, f"{name} nvfp4 packed given={given is not None}")
            assert_rows(bs, bs_ref, layout, poison[1], seed, f"{name} nvfp4 block scales")


@pytest.mark.parametrize("hidden_size", [1, 72, 200, 7168])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("offset", [0, 1])  # 1: rows not 16-byte aligned, the element-wise path
def test_permute_copy_matches_reference(hidden_size, dtype, offset, generator):
    seed = generator.initial_seed()
    ids = make_ids(generator, 333, 4, 16, "holes")
    wide = randn(generator, 333, hidden_size + offset, dtype=dtype).cuda()
    x = wide[:, offset:]
    for name, layout in _layouts(ids, 16):
        cpu = cpu_layout(layout, ids)
        out = poisoned((*layout.rows_shape, hidden_size), dtype)
        poison = out.clone()
        got = fm.permute(x, layout, out=out)
        assert_rows(got, ref.permute(x.cpu(), cpu), layout, poison, seed, f"{name} copy")


# ---------------------------------------------------------------------------------------------- quantizers


@pytest.mark.parametrize("shape", [(1, 128), (3, 7, 256), (1000, 7168), (4096, 2048)])
@pytest.mark.parametrize("dtype", FLOATS)
def test_quantizers_match_reference(shape, dtype, generator):
    seed = generator.initial_seed()
    x = randn(generator, *shape, dtype=dtype)
    xc = x.cuda()
    pairs = {
        "group": (lambda a: fm.quantize_fp8_per_token_group(a), lambda a: ref.quantize_fp8_per_token_group(a)),
        "group64 pow2": (
            lambda a: fm.quantize_fp8_per_token_group(a, 64, scale_pow2=True),
            lambda a: ref.quantize_fp8_per_token_group(a, 64, scale_pow2=True),
        ),
        "tensor": (lambda a: fm.quantize_fp8_per_tensor(a), lambda a: ref.quantize_fp8_per_tensor(a)),
        "tensor given": (lambda a: fm.quantize_fp8_per_tensor(a, 0.01), lambda a: ref.quantize_fp8_per_tensor(a, 0.01)),
        "nvfp4": (lambda a: fm.quantize_nvfp4(a), lambda a: ref.quantize_nvfp4(a)),
        "nvfp4 given": (lambda a: fm.quantize_nvfp4(a, 0.002), lambda a: ref.quantize_nvfp4(a, 0.002)),
        "block": (lambda a: fm.quantize_fp8_block_weights(a), lambda a: ref.quantize_fp8_block_weights(a)),
        "block 64x32": (
            lambda a: fm.quantize_fp8_block_weights(a, (64, 32)),
            lambda a: ref.quantize_fp8_block_weights(a, (64, 32)),
        ),
    }
    for name, (kernel, oracle) in pairs.items():
        got, want = kernel(xc), oracle(x)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert a.shape == b.shape and a.dtype == b.dtype, f"{name} output {i}: {a.shape} {a.dtype} vs {b.shape}"
            assert torch.equal(bits(a), bits(b)), f"seed {seed}: {name} output {i} differs"
    packed, block_scales, gs = ref.quantize_nvfp4(x)
    out = poisoned((*shape[:-1], shape[-1]), torch.float32)
    got = fm.dequantize_nvfp4(packed.cuda(), block_scales.cuda(), gs.cuda(), out=out)
    assert torch.equal(got.cpu(), ref.dequantize_nvfp4(packed, block_scales, gs)), f"seed {seed}: dequantize_nvfp4"


def test_quantizer_grid_edges():
    # Every E2M1 value and every midpoint, both signs, with global scale 1 and block amax 6 (block scale 1);
    # then blocks that saturate the E4M3 block scale, all-zero blocks and subnormal-scale blocks.
    grid = [0, 0.5, 1, 1.5, 2, 3, 4, 6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6]
    rows = [
        grid,
        [-v for v in grid],
        [0.0] * 16,
        [1e-30 * (i + 1) for i in range(16)],
        [1e6 * (i - 8) for i in range(16)],
    ]
    x = torch.tensor(rows, dtype=torch.float32)
    for gs in (1.0, 1e-3, None):
        got = fm.quantize_nvfp4(x.cuda(), gs)
        want = ref.quantize_nvfp4(x, gs)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want, strict=True)), f"global scale {gs}"
    x = torch.tensor([[896.0, 34.0, 38.0, 3.0, -1e9, 1e-40, 0.0, -0.0] * 16] * 2)
    x[1] *= 1e-39
    for pow2 in (False, True):
        got = fm.quantize_fp8_per_token_group(x.cuda(), scale_pow2=pow2)
        want = ref.quantize_fp8_per_token_group(x, scale_pow2=pow2)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want, strict=True)), f"pow2 {pow2}"


# ---------------------------------------------------------------------------------------------- combine


@pytest.mark.parametrize(
    "num_tokens, top_k, num_experts, hidden_size",
    [(1, 1, 8, 8), (3, 2, 4, 200), (1000, 8, 64, 2048), (4096, 8, 256, 7168)],
)
@pytest.mark.parametrize(
    "y_dtype, out_dtype",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
    ],
)
def test_combine_matches_reference(num_tokens, top_k, num_experts, hidden_size, y_dtype, out_dtype, generator):
    seed = generator.initial_seed()
    ids = make_ids(generator, num_tokens, top_k, num_experts, "holes")
    weights = torch.rand(num_tokens, top_k, generator=generator)
    residual = randn(generator, num_tokens, hidden_size, dtype=out_dtype)
    for name, layout in _layouts(ids, num_experts):
        cpu = cpu_layout(layout, ids)
        y = randn(generator, layout.num_rows, hidden_size, dtype=y_dtype)
        y[cpu.source_of < 0] = float("nan")  # rows that hold no pair must never be read
        y = y.view(*layout.rows_shape, hidden_size)
        for kwargs in (dict(), dict(routed_scaling_factor=2.5, residual=residual)):
            out = poisoned((num_tokens, hidden_size), out_dtype)
            on_gpu = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            got = fm.combine(y.cuda(), weights.cuda(), layout, out_dtype=out_dtype, out=out, **on_gpu)
            want = ref.combine(y, weights, cpu, out_dtype=out_dtype, **kwargs)
            assert torch.equal(got.cpu(), want), f"seed {seed}: {name} combine {sorted(kwargs)} differs"


def test_combine_unaligned_and_all_skipped(generator):
    ids = torch.full((5, 3), -1, dtype=torch.int32)
    ids[2, 1] = 1
    layout = fm.moe_align_contiguous(ids.cuda(), 4, 8)
    y = randn(generator, layout.num_rows, 33).cuda()  # H % 8 != 0: the element-wise path
    w = torch.rand(5, 3, generator=generator).cuda()
    got = fm.combine(y, w, layout)
    want = ref.combine(y.cpu(), w.cpu(), ref.moe_align_contiguous(ids, 4, 8))
    assert torch.equal(got.cpu(), want) and (got[[0, 1, 3, 4]] == 0).all()


# ---------------------------------------------------------------------------------------------- capture


def test_cuda_graph_layer_replays_with_fresh_inputs(generator):
    num_tokens, top_k, num_experts, hidden_size, capacity = 128, 8, 64, 2048, 40
    ids = make_ids(generator, num_tokens, top_k, num_experts, "skewed").cuda()
    x = randn(generator, num_tokens, hidden_size, dtype=torch.bfloat16).cuda()
    w = torch.rand(num_tokens, top_k, generator=generator).cuda()
    gs = torch.tensor(0.01, device="cuda")

    def layer():
        layout = fm.moe_align_masked(ids, num_experts, capacity)
        q, s = fm.permute_fp8_per_token_group(x, layout)
        packed, bs, _ = fm.permute_nvfp4(x, layout, gs)
        y = (q.float() * s.repeat_interleave(128, -1)).to(torch.bfloat16)  # a stand-in expert: dequantize
        return layout, q, s, packed, bs, fm.combine(y, w, layout, routed_scaling_factor=2.5)

    layer()  # compile and load outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = layer()
    for _ in range(3):
        ids.copy_(make_ids(generator, num_tokens, top_k, num_experts, "skewed"))
        x.copy_(randn(generator, num_tokens, hidden_size, dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        eager = layer()
        cpu = ref.moe_align_masked(ids.cpu(), num_experts, capacity)
        assert_layout_equal(outs[0], cpu, generator.initial_seed())
        for a, b, what in zip(outs[1:], eager[1:], ("q", "scales", "packed", "block scales", "combine"), strict=True):
            if what == "combine":
                assert torch.equal(a, b), what
            else:  # rows that hold no pair are unspecified: compare the owned ones
                assert_rows(a, b, cpu, None, generator.initial_seed(), f"graph {what}")


def test_torch_compile_fullgraph(generator):
    ids = make_ids(generator, 64, 4, 16, "holes").cuda()
    x = randn(generator, 64, 256, dtype=torch.bfloat16).cuda()
    w = torch.rand(64, 4, generator=generator).cuda()

    def layer(x, ids, w):
        layout = fm.moe_align_contiguous(ids, 16, 32)
        q, s = fm.permute_fp8_per_token_group(x * 1, layout)
        y = (q.float() * s.repeat_interleave(128, -1)).to(torch.bfloat16)
        return fm.combine(y, w, layout)

    compiled = torch.compile(layer, fullgraph=True)
    assert torch.equal(compiled(x, ids, w), layer(x, ids, w))
