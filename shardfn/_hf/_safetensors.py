"""The safetensors format, read by byte range and written by stream, without the package.

[Note: reading only this rank's bytes] A safetensors file is an 8-byte little-endian
header length, a JSON header `{name: {"dtype", "shape", "data_offsets": [begin, end]}}`
(plus an optional `"__metadata__"`), then the tensors' bytes, row-major, offsets relative
to the end of the header. A rank's part of a leaf is a box of global index ranges (its
dim-0 chunk, and with tensor parallelism its columns): `read` seeks to the box's first
element and reads the contiguous span up to its last one, exactly the box's bytes when
only dim 0 is split (FSDP) and at most the box's full rows otherwise, then takes the box
out of that span. The package's `safe_open` maps the file into memory, where bytes
"read" are page faults nobody can count; a plain `readinto` on an open file is counted
in `ReadStats`, so the tests can assert what each rank read.

Writing streams the same way: `Writer` lays out every tensor's offsets first (their
shapes and dtypes are known before any is gathered), writes the header, then each
tensor's bytes at its offset as it arrives, so the writer holds one tensor at a time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import sys

import torch

from .._checkpoint._errors import CheckpointError

__all__ = ["DTYPES", "Header", "ReadStats", "read_header", "read_box", "Writer"]

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100_000_000  # the safetensors package's own limit


@dataclasses.dataclass
class ReadStats:
    """What one rank read from the checkpoint files (bytes counted where they are read)."""

    header_bytes: int = 0  # 8-byte lengths and JSON headers of the files opened
    data_bytes: int = 0  # tensor bytes read
    wanted_bytes: int = 0  # bytes of this rank's blocks (in the files' dtypes)
    row_bytes: int = 0  # bytes of the full rows its blocks lie in
    max_read_bytes: int = 0  # the largest single read: the most held beyond the shards
    reads: int = 0  # tensor reads (one per leaf with a non-empty block)
    files: int = 0  # files opened

    @property
    def total_bytes(self) -> int:
        return self.header_bytes + self.data_bytes


@dataclasses.dataclass(frozen=True)
class Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte


@dataclasses.dataclass(frozen=True)
class Header:
    path: str
    entries: dict[str, Entry]
    metadata: dict


def _check_byteorder() -> None:
    if sys.byteorder != "little":
        raise CheckpointError("sf.hf: safetensors files are little-endian; this machine is not")


def read_header(path: str, stats: ReadStats | None = None) -> Header:
    """Parse a file's header (reads 8 + its length bytes).

    Raises:
      CheckpointError: the file is not a valid safetensors file (naming it and what is wrong).
    """
    _check_byteorder()
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError(f"sf.hf: {path!r} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER:
            raise CheckpointError(f"sf.hf: {path!r} is not a safetensors file (header length {n})")
        raw = f.read(n)
        size = os.fstat(f.fileno()).st_size
    if stats is not None:
        stats.header_bytes += 8 + len(raw)
        stats.files += 1
    try:
        header = json.loads(raw)
    except ValueError as err:
        raise CheckpointError(f"sf.hf: {path!r}: the safetensors header is not JSON ({err})") from None
    metadata = header.pop("__metadata__", None) or {}
    start = 8 + n
    entries = {}
    for name, info in header.items():
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"sf.hf: {path!r}: tensor {name!r} has dtype {info.get('dtype')!r}, which "
                                  f"shardfn does not read (known: {sorted(DTYPES)})")
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(x) for x in info["data_offsets"])
        if end - begin != math.prod(shape) * dtype.itemsize or start + end > size:
            raise CheckpointError(f"sf.hf: {path!r}: tensor {name!r} ({shape}, {info['dtype']}) has data offsets "
                                  f"[{begin}, {end}] that do not fit its size or the file; the file is damaged")
        entries[name] = Entry(dtype, shape, start + begin)
    return Header(path, entries, metadata)


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return out[::-1]


def read_box(f, entry: Entry, box: list[tuple[int, int]], stats: ReadStats) -> torch.Tensor:
    """The box `[(start, stop) per dim]` of a tensor, read from the open file `f`.

    Reads the contiguous span from the box's first element to its last one
    ([Note: reading only this rank's bytes]); returns a new contiguous tensor in the
    file's dtype.
    """
    shape = tuple(b - a for a, b in box)
    item = entry.dtype.itemsize
    strides = _strides(entry.shape)
    stats.wanted_bytes += math.prod(shape) * item
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=entry.dtype)
    rows = shape[0] * strides[0] if entry.shape else 1
    stats.row_bytes += rows * item
    first = sum(a * s for (a, _), s in zip(box, strides))
    last = sum((b - 1) * s for (_, b), s in zip(box, strides))
    n = (last - first + 1) * item
    buf = bytearray(n)
    f.seek(entry.begin + first * item)
    got = f.readinto(buf)
    if got != n:
        raise CheckpointError(f"sf.hf: {getattr(f, 'name', '?')!r}: short read ({got} of {n} bytes); "
                              f"the file is truncated")
    stats.data_bytes += n
    stats.reads += 1
    stats.max_read_bytes = max(stats.max_read_bytes, n)
    span = torch.frombuffer(buf, dtype=entry.dtype)
    return span.as_strided(shape, strides).clone()


class Writer:
    """One safetensors file written tensor by tensor, at offsets fixed up front."""

    def __init__(self, path: str, layout: list[tuple[str, tuple[int, ...], torch.dtype]], metadata: dict[str, str]):
        header: dict = {"__metadata__": metadata}
        self.offsets: dict[str, tuple[int, int]] = {}
        pos = 0
        for name, shape, dtype in layout:
            n = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [pos, pos + n]}
            self.offsets[name] = (pos, n)
            pos += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the package writes it
        self.start = 8 + len(raw)
        self.size = self.start + pos
        self.path = path
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(raw)) + raw)
        self.file.truncate(self.size)
        self.written: set[str] = set()

    def write(self, name: str, t: torch.Tensor) -> None:
        begin, n = self.offsets[name]
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        if data.numel() != n:
            raise CheckpointError(f"sf.hf: {name!r}: {data.numel()} bytes to write where the header has {n}")
        self.file.seek(self.start + begin)
        self.file.write(memoryview(data.numpy()))
        self.written.add(name)

    def close(self) -> None:
        missing = set(self.offsets) - self.written
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        if missing:
            raise CheckpointError(f"sf.hf: {self.path!r}: tensors never written: {sorted(missing)}")
