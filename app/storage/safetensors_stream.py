"""safetensors files written one tensor at a time: a checkpoint of any size never needs a second copy in memory.

The file is the format safetensors' own loader reads (`safetensors.torch.load_file`); the header is built from
each tensor's dtype and shape, then the tensors follow in order.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import BinaryIO

import torch

from app.storage.local import temp_sibling

_CHUNK = 8 << 20


_DTYPE_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
_DTYPE_CODES.update(
    {
        getattr(torch, name): code
        for name, code in (
            ("uint16", "U16"),
            ("uint32", "U32"),
            ("uint64", "U64"),
            ("float8_e4m3fn", "F8_E4M3"),
            ("float8_e5m2", "F8_E5M2"),
        )
        if hasattr(torch, name)
    }
)


def _header(entries: list[tuple[str, torch.dtype, list[int], int]], metadata: Mapping[str, str] | None) -> bytes:
    """The 8-byte little-endian length, then the JSON header padded with spaces to a multiple of 8."""
    header: dict = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}} if metadata else {}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        if name in header or name == "__metadata__":
            raise ValueError(f"tensor name {name!r} is repeated or reserved")
        if dtype not in _DTYPE_CODES:
            raise TypeError(f"tensor {name!r} has dtype {dtype}, which safetensors cannot store")
        header[name] = {"dtype": _DTYPE_CODES[dtype], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _describe(name: str, tensor: torch.Tensor) -> tuple[str, torch.dtype, list[int], int]:
    return name, tensor.dtype, list(tensor.shape), tensor.numel() * tensor.element_size()


def _write_tensor(f: BinaryIO, tensor: torch.Tensor) -> None:
    """The tensor's raw bytes (little-endian, like safetensors); only this one tensor is copied to the CPU."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    f.write(memoryview(flat.view(torch.uint8).numpy()))


def stream_save_safetensors(
    path: str | Path,
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Writes a safetensors file tensor by tensor, then fsyncs it.

    safetensors' own save_file serializes the whole dict into one bytes object in memory before writing,
    so its peak memory is about the size of the file (on top of the tensors); here the peak stays near the
    largest single tensor. A Mapping is read twice (shapes for the header, then bytes); any other iterable
    is consumed once, its bytes going to a sidecar file until every shape for the header is known.
    """
    path = Path(path)
    with open(path, "wb") as out:
        if isinstance(tensors, Mapping):
            out.write(_header([_describe(n, t) for n, t in tensors.items()], metadata))
            for tensor in tensors.values():
                _write_tensor(out, tensor)
        else:
            sidecar = temp_sibling(path)
            try:
                with open(sidecar, "w+b") as data:
                    entries = []
                    for name, tensor in tensors:
                        entries.append(_describe(name, tensor))
                        _write_tensor(data, tensor)
                    out.write(_header(entries, metadata))
                    data.seek(0)
                    while chunk := data.read(_CHUNK):
                        out.write(chunk)
            finally:
                sidecar.unlink(missing_ok=True)
        out.flush()
        os.fsync(out.fileno())
