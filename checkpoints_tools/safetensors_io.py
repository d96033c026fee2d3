"""Hugging Face weight files: streaming safetensors shards out, bounded-memory reads in.

Writing: the safetensors header lists every tensor's shape and byte range, and all of
them are known from the model config before any weight is converted, so a shard is
written header first and then tensor by tensor, each produced only when its turn comes:
memory holds one tensor, never a shard (`safetensors.torch.save_file` needs the whole
shard as a dict).

Reading: safetensors files are memory-mapped one tensor at a time. Pickle-based weights
(`pytorch_model*.bin`, `*.pt`) execute code when unpickled; they are refused unless the
caller says the source is trusted, and even then read with torch's restricted unpickler.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
from safetensors import safe_open

SAFE_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
INDEX_NAME = "model.safetensors.index.json"


class HFFormatError(ValueError):
    """A Hugging Face directory that cannot be read; the message names the file and the fix."""


def plan_shards(entries: list[tuple[str, tuple, torch.dtype]], max_bytes: int) -> list[list[tuple[str, tuple, torch.dtype]]]:
    """Greedy packing in order: a shard closes before the tensor that would overflow it."""
    shards, current, size = [], [], 0
    for entry in entries:
        nbytes = math.prod(entry[1]) * entry[2].itemsize
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += nbytes
    if current:
        shards.append(current)
    return shards


def write_safetensors(path: Path, entries: list[tuple[str, tuple, torch.dtype]],
                      produce: Callable[[str], torch.Tensor], on_tensor: Optional[Callable[[int], None]] = None) -> None:
    """Write one safetensors file; produce(name) is called in `entries` order."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": SAFE_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name, shape, dtype in entries:
            tensor = produce(name).to(dtype).contiguous()
            if tuple(tensor.shape) != tuple(shape):
                raise AssertionError(f"{name}: produced shape {tuple(tensor.shape)}, planned {tuple(shape)}")
            f.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
            if on_tensor:
                on_tensor(tensor.numel() * tensor.element_size())


def write_index(out: Path, weight_map: dict[str, str], total_bytes: int) -> None:
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


class HFWeights:
    """Tensors of a Hugging Face model directory, read one at a time."""

    def __init__(self, directory: Path, *, trust_pickle: bool = False):
        self.directory = Path(directory)
        self.files = self._weight_files(trust_pickle)  # name -> file
        self._open_file, self._handle = None, None

    def _weight_files(self, trust_pickle: bool) -> dict[str, Path]:
        d = self.directory
        index = d / INDEX_NAME
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            missing = sorted({f for f in weight_map.values() if not (d / f).is_file()})
            if missing:
                raise HFFormatError(f"{d}: {INDEX_NAME} lists shard(s) that are missing: {', '.join(missing)}; "
                                    "copy the complete model directory")
            return {name: d / f for name, f in weight_map.items()}
        singles = sorted(d.glob("*.safetensors"))
        if singles:
            return {name: f for f in singles for name in self._names_in(f)}
        pickles = sorted([*d.glob("*.bin"), *d.glob("*.pt"), *d.glob("*.pth")])
        if pickles and not trust_pickle:
            raise HFFormatError(
                f"{d} holds pickle weights ({', '.join(p.name for p in pickles)}) and no safetensors; "
                "unpickling can run arbitrary code, so they are refused. Convert them to safetensors "
                "(save_pretrained with safe_serialization) or, if you trust the source, pass --trust-pickle")
        if pickles:
            return self._pickle_files(pickles)
        raise HFFormatError(f"{d} holds no model weights (no *.safetensors, no {INDEX_NAME})")

    def _pickle_files(self, pickles: list[Path]) -> dict[str, Path]:
        index = self.directory / "pytorch_model.bin.index.json"
        if index.is_file():
            files = {name: self.directory / f for name, f in json.loads(index.read_text())["weight_map"].items()}
            missing = sorted({str(f.name) for f in files.values() if not f.is_file()})
            if missing:
                raise HFFormatError(f"{index} lists missing shard(s): {', '.join(missing)}")
            return files
        return {name: f for f in pickles for name in self._load_pickle(f)}

    @staticmethod
    def _names_in(file: Path) -> list[str]:
        try:
            with safe_open(str(file), framework="pt") as f:
                return list(f.keys())
        except Exception as exc:  # safetensors raises its own error types for bad headers
            raise HFFormatError(f"{file} is not a readable safetensors file ({exc})") from None

    @staticmethod
    def _load_pickle(file: Path) -> dict:
        # Trusted by the caller, still read with the restricted unpickler and memory-mapped.
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)

    def names(self) -> Iterable[str]:
        return self.files.keys()

    def _file(self, name: str):
        if name not in self.files:
            raise HFFormatError(f"{self.directory}: tensor {name!r} is missing from the model files")
        file = self.files[name]
        if file != self._open_file:
            self._close()
            try:
                if file.suffix == ".safetensors":
                    self._handle = safe_open(str(file), framework="pt")
                    self._handle.__enter__()
                else:
                    self._handle = self._load_pickle(file)
            except Exception as exc:  # safetensors' and torch's own error types for a damaged file
                raise HFFormatError(f"{file} is not a readable weight file ({type(exc).__name__}: "
                                    f"{str(exc).splitlines()[0] if str(exc) else ''}); copy the model "
                                    "directory again") from None
            self._open_file = file
        return self._handle

    def shape(self, name: str) -> tuple[int, ...]:
        handle = self._file(name)
        if isinstance(handle, dict):
            return tuple(handle[name].shape)
        return tuple(handle.get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        handle = self._file(name)
        return handle[name] if isinstance(handle, dict) else handle.get_tensor(name)

    def _close(self) -> None:
        if self._handle is not None and not isinstance(self._handle, dict):
            self._handle.__exit__(None, None, None)
        self._handle, self._open_file = None, None

    def close(self) -> None:
        self._close()
