"""The README's Python blocks run as written: all of them, in order, in one namespace (each block may continue
from the ones before it), in a fresh process with no GPU visible, so that the CPU path is what runs and a
snippet that hangs, or leaves a process group behind, fails here instead of in a newcomer's shell."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
TIMEOUT_S = 300

# Each block is compiled with blank lines in front, so that a traceback names the README's own line numbers.
RUNNER = """
import json, sys

readme, blocks = sys.argv[1], json.load(sys.stdin)
namespace = {"__name__": "__main__"}
for line, code in blocks:
    exec(compile("\\n" * line + code, readme, "exec"), namespace)

import torch.distributed as dist

if dist.is_available() and dist.is_initialized():
    sys.exit("the README's blocks leave a torch.distributed process group initialized")
print(f"ran {len(blocks)} block(s)")
"""


def python_blocks(text: str) -> list[tuple[int, str]]:
    """Every ```python block of ``text``, in order: ``(lines before its code, its code)``."""
    blocks = []
    for match in re.finditer(r"^```python[ \t]*\n(.*?)^```[ \t]*$", text, re.MULTILINE | re.DOTALL):
        blocks.append((text.count("\n", 0, match.start(1)), match.group(1)))
    return blocks


def _text(output) -> str:
    """What a timed-out process had written (bytes even under ``text=True`` on some Pythons)."""
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def test_python_blocks_are_found():
    blocks = python_blocks("text\n\n```python\nx = 1\n```\n\n```bash\nls\n```\n\n```python\ny = x\n```\n")
    assert blocks == [(3, "x = 1\n"), (11, "y = x\n")]


def test_readme_python_blocks_run(tmp_path):
    blocks = python_blocks(README.read_text())
    assert blocks, "README.md has no ```python block: nothing would be checked"
    # No GPU, and no TRITON_INTERPRET (which conftest sets in this process): what a newcomer's CPU-only shell has.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-c", RUNNER, str(README)]
    try:
        proc = subprocess.run(
            cmd, input=json.dumps(blocks), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"the README's Python blocks did not finish within {TIMEOUT_S} s:\n{_text(exc.stdout)}{_text(exc.stderr)}"
        )
    assert proc.returncode == 0, (
        f"the README's Python blocks failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"
    )
    assert f"ran {len(blocks)} block(s)" in proc.stdout, proc.stdout + proc.stderr
