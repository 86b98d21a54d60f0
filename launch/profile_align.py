"""Runs the layout kernels a few times at DeepSeek-V3 decode and prefill sizes, for a profiler:

ncu --clock-control none --kernel-name regex:align -c 8 python launch/profile_align.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import require_gpus  # noqa: E402

require_gpus(1)

import torch  # noqa: E402

import flashinfer_moe as fm  # noqa: E402

gen = torch.Generator().manual_seed(0)
for tokens in (128, 4096):
    ids = torch.rand(tokens, 256, generator=gen).argsort(-1)[:, :8].int().cuda()
    for _ in range(2):
        fm.moe_align_contiguous(ids, 256, 128, validate=False)
        fm.moe_align_masked(ids, 256, tokens, validate=False)
torch.cuda.synchronize()
