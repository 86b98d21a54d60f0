"""Reading checkpoint tensors from safetensors files on demand, so that a rank reads only what it keeps."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

__all__ = ["SafetensorsMapping"]


class SafetensorsMapping(Mapping):
    """A read-only mapping of tensor names to tensors over one ``.safetensors`` file or a folder of them; a
    tensor is read from disk when it is looked up, not before. Use it as a context manager (or call
    :meth:`close`) to release the files.

    Args:
        path: a ``.safetensors`` file, or a folder holding them (with its ``*.safetensors.index.json``
            ``weight_map`` where there is one, else every ``*.safetensors`` file in it).
        device: where the tensors are put (``"cpu"`` by default).

    Raises:
        FileNotFoundError: the path does not exist, or a folder holds no ``.safetensors`` file.
        ValueError: two files hold the same tensor name.
    """

    def __init__(self, path: str | Path, device: str | torch.device = "cpu"):
        try:
            from safetensors import safe_open
        except ImportError as exc:  # a dependency of the package; missing only in a broken environment
            raise ImportError("reading safetensors checkpoints needs the safetensors package") from exc
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"path must be a .safetensors file or a folder of them, got {str(path)!r}")
        if path.is_dir():
            indexes = sorted(path.glob("*.safetensors.index.json"))
            if indexes:
                weight_map = json.loads(indexes[0].read_text())["weight_map"]
                files = sorted({path / name for name in weight_map.values()})
            else:
                files = sorted(path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"path must hold .safetensors files, got none in {str(path)!r}")
        else:
            files = [path]
        self._device = str(torch.device(device))
        self._handles = [safe_open(str(f), framework="pt", device=self._device) for f in files]
        self._where: dict[str, int] = {}
        for index, handle in enumerate(self._handles):
            for key in handle.keys():
                if key in self._where:
                    raise ValueError(
                        f"path must not hold a tensor twice, got {key!r} in {files[self._where[key]].name} and "
                        f"{files[index].name}"
                    )
                self._where[key] = index

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._handles[self._where[key]].get_tensor(key)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def close(self) -> None:
        self._handles.clear()
        self._where.clear()

    def __enter__(self) -> SafetensorsMapping:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
