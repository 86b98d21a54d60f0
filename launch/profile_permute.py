"""Runs the layout, permute and combine kernels a few times at DeepSeek-V3 decode (128 tokens) and prefill (4096)
sizes, for a profiler:

ncu --clock-control none --kernel-name regex:'scatter|combine|align' -c 16 python launch/profile_permute.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import require_gpus  # noqa: E402

require_gpus(1)

import torch  # noqa: E402

import flashinfer_moe as fm  # noqa: E402

K, E, H = 8, 256, 7168
gen = torch.Generator().manual_seed(0)
for tokens in (128, 4096):
    ids = torch.rand(tokens, E, generator=gen).argsort(-1)[:, :K].int().cuda()
    x = torch.randn(tokens, H, generator=gen).bfloat16().cuda()
    w = torch.rand(tokens, K, generator=gen).cuda()
    for _ in range(2):
        fm.moe_align_masked(ids, E, tokens, validate=False)
        layout = fm.moe_align_contiguous(ids, E, 128, validate=False)
        fm.permute(x, layout)
        fm.permute_fp8_per_token_group(x, layout)
        fm.permute_nvfp4(x, layout, torch.tensor(0.002, device="cuda"))
        y = torch.randn(layout.num_rows, H, device="cuda").bfloat16()
        fm.combine(y, w, layout)
torch.cuda.synchronize()
