"""The tile configs ``launch/bench_nvfp4.py --sweep`` (and ``--sweep-kperm``) times per shape class of
``moe.gemm_nvfp4_kernel.CONFIGS``: for each class the problem it is timed on and the candidates (the table's own
config is tried before them)."""


def _cfg(bm, bn, bk, warps, stages, swap=True, group_m=8):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, SWAP_AB=swap, GROUP_M=group_m)


# Per class: (problem, candidates); the table's current config is tried first.
SWEEP = {
    "decode": (
        ("masked", 32, 16, 4096, 7168, False),
        [
            _cfg(16, 64, 128, 4, 6),
            _cfg(16, 128, 64, 4, 6),
            _cfg(16, 128, 128, 4, 6),
            _cfg(16, 256, 64, 8, 4),
            _cfg(16, 128, 128, 8, 4),
            _cfg(32, 128, 128, 4, 4),
        ],
    ),
    "decode_gated": (
        ("masked", 32, 16, 4096, 7168, True),
        [_cfg(16, 128, 64, 4, 4), _cfg(16, 64, 128, 4, 6), _cfg(16, 128, 128, 8, 4), _cfg(32, 64, 128, 4, 4)],
    ),
    "mid64": (
        ("masked", 32, 64, 4096, 7168, False),
        [_cfg(64, 64, 128, 4, 4), _cfg(64, 128, 128, 4, 4), _cfg(64, 256, 64, 8, 3), _cfg(128, 128, 64, 8, 3)],
    ),
    "mid64_gated": (
        ("masked", 32, 64, 4096, 7168, True),
        [_cfg(64, 64, 128, 4, 4), _cfg(64, 128, 64, 8, 3), _cfg(128, 64, 64, 8, 3)],
    ),
    "mid": (
        ("masked", 32, 128, 4096, 7168, False),
        [
            _cfg(64, 128, 128, 4, 4),
            _cfg(128, 128, 64, 8, 3),
            _cfg(64, 256, 64, 8, 3),
            _cfg(64, 128, 64, 4, 4, swap=False),
        ],
    ),
    "mid_gated": (
        ("masked", 32, 128, 4096, 7168, True),
        [_cfg(64, 128, 64, 8, 3), _cfg(64, 64, 128, 4, 4), _cfg(128, 64, 64, 8, 3), _cfg(64, 64, 64, 4, 4, swap=False)],
    ),
    "prefill": (
        ("contiguous", 8, 4096, 4096, 7168, False),
        [
            _cfg(128, 256, 64, 8, 3),
            _cfg(256, 128, 64, 8, 3),
            _cfg(128, 128, 128, 8, 3),
            _cfg(128, 128, 64, 8, 4),
            _cfg(128, 128, 64, 8, 3, swap=False),
        ],
    ),
    "prefill_gated": (
        ("contiguous", 8, 4096, 4096, 7168, True),
        [
            _cfg(128, 128, 64, 8, 3),
            _cfg(256, 64, 64, 8, 3),
            _cfg(128, 64, 128, 8, 3),
            _cfg(128, 64, 64, 8, 3, swap=False),
        ],
    ),
}
