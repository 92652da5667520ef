"""A GGUF file read in place: its metadata, its tensor table, and each tensor's bytes.

Why not gguf-py's GGUFReader: it parses every metadata array element by element (the whole
vocabulary, the merges), seconds of every start-up for a 50k-token vocabulary; transformers'
reader is fast but refuses formats a file may hold (Q5_0, Q5_1) and names the path in its errors.
This one walks the header once (string arrays only counted, decoded when asked: `strings`), and
reads a tensor's bytes when asked, with pread into memory of our own, so the file's pages stay
in the page cache and out of the process's resident set: whole (`blocks`), or row by row for a tensor read a few rows at a
time for as long as the model serves (`row_reader`: the token embeddings). Not through the
mapping: a fault on a mapped file maps the pages around it too (64 KiB), so a table looked up
at random rows becomes resident almost whole (Gemma 3's 262k-token table: +127 MiB after 4,096
random rows). gguf-py still gives the formats' block sizes and the dequantization.

Errors never quote the file's path: a request or a log line may carry them.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import struct
import weakref
from collections.abc import Iterator
from math import prod
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from trillm.model.unservable import UnservableModel

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # v1 counted in 32 bits; no file in use still has it
DEFAULT_ALIGNMENT = 32
# metadata value types of a fixed width -> struct format
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# a read of more than this is split (Linux moves at most ~2 GiB in one call)
_READ_CHUNK = 1 << 30


def _folio_span() -> int:
    """The largest folio the page cache maps a file in: a huge page's size (2 MiB on x86-64)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return max(int(f.read()), mmap.PAGESIZE)
    except (OSError, ValueError):
        return 2 << 20


FOLIO_SPAN = _folio_span()


def _read_into(fd: int, out: np.ndarray, offset: int) -> None:
    """Fill `out` (contiguous) with the file's bytes from `offset` on."""
    view, done = memoryview(out).cast("B"), 0
    while done < len(view):
        n = os.preadv(fd, [view[done : done + _READ_CHUNK]], offset + done)
        if n <= 0:
            raise UnservableModel("The model file ends inside a tensor.")
        done += n


class TensorRows:
    """Rows of one tensor, read from the file when asked (GGUFFile.row_reader). Owns a file
    descriptor: `close()` gives it back (idempotent; done too when the object is collected)."""

    def __init__(self, fd: int, info: TensorInfo):
        self.rows, self.row_bytes = info.rows, info.row_bytes
        self._fd, self._offset = fd, info.offset
        self._close = weakref.finalize(self, os.close, fd)

    def __getitem__(self, ids: np.ndarray) -> np.ndarray:
        """[len(ids), row_bytes] uint8: the rows `ids` names (each in [0, rows)), in their
        order. Each run of consecutive rows among them is one read."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        assert not len(ids) or 0 <= ids.min() <= ids.max() < self.rows, "row ids outside the tensor"
        unique, inverse = np.unique(ids, return_inverse=True)
        out = np.empty((len(unique), self.row_bytes), dtype=np.uint8)
        starts = np.flatnonzero(np.diff(unique, prepend=-2) != 1)
        for first, last in zip(starts.tolist(), [*starts[1:].tolist(), len(unique)]):
            _read_into(self._fd, out[first:last], self._offset + int(unique[first]) * self.row_bytes)
        return out[inverse]

    def close(self) -> None:
        self._close()


class TensorInfo(NamedTuple):
    name: str
    kind: GGMLQuantizationType
    shape: tuple[int, ...]  # torch's order: rows first (GGUF lists the fastest dimension first)
    offset: int  # from the start of the file
    nbytes: int

    @property
    def rows(self) -> int:
        return prod(self.shape[:-1])

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.rows


class GGUFFile:
    """One open GGUF file. `close()` is idempotent and the object a context manager; row
    readers it handed out (`row_reader`) stay open after it closes."""

    def __init__(self, path: str):
        """UnservableModel when the file is not a GGUF file this reader understands (a bad magic,
        version, value type or tensor format, or a table that runs past the end)."""
        self._fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(self._fd).st_size
            if size < 24:
                raise UnservableModel("The model file is too short to be a GGUF file.")
            self._header = mmap.mmap(self._fd, 0, prot=mmap.PROT_READ)  # slices are bytes: strings read fast
            self._map = np.frombuffer(self._header, dtype=np.uint8)
            self.metadata, self.tensors = self._parse(size)
        except (struct.error, UnicodeDecodeError, ValueError, OverflowError) as exc:
            os.close(self._fd)
            if isinstance(exc, UnservableModel):
                raise
            raise UnservableModel(f"The model file is not a readable GGUF file ({type(exc).__name__}).") from None
        except BaseException:
            os.close(self._fd)
            raise
        self.architecture: str = self.metadata.get("general.architecture", "")

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def strings(self, key: str) -> list[str]:
        """A metadata array of strings (the header reader only counted it), read whole; its
        bounds were checked when the header was read."""
        strings = self.metadata[key]
        assert isinstance(strings, StringCount), key
        header, pos, out = self._header, strings.at, []
        for _ in range(strings):
            (length,) = struct.unpack_from("<Q", header, pos)
            out.append(header[pos + 8 : pos + 8 + length].decode())
            pos += 8 + length
        return out

    def field(self, key: str, default=None):
        """The architecture's own metadata key (`llama.block_count` for "block_count")."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def blocks(self, name: str, rows: slice = slice(None)) -> np.ndarray:
        """[rows, bytes of a row] uint8: the tensor's bytes (some of its rows), read into memory
        of its own, which the caller owns."""
        info = self.tensors[name]
        start, stop, _ = rows.indices(info.rows)
        out = np.empty((stop - start, info.row_bytes), dtype=np.uint8)
        _read_into(self._fd, out, info.offset + start * info.row_bytes)
        return out

    @contextlib.contextmanager
    def mapped(self, name: str, rows: slice = slice(None)) -> Iterator[np.ndarray]:
        """[rows, bytes of a row] uint8, read-only: the tensor's rows (some of them) where the
        file is mapped, no copy made; on the way out the pages they were read through are
        unmapped from this process (the page cache keeps them), so that a load that reads every
        tensor this way holds no more than one of them as file pages. Unmapped out to the bounds
        of the largest folio the page cache makes (FOLIO_SPAN): a fault maps the whole folio it
        hits, and a file just written in 1 MiB writes sits in folios that straddle tensors, whose
        pages outside the rows read would stay mapped until the file closes (58 MiB of Gemma 3
        270M's load). The mapping is read-only, so unmapping a neighbour's pages costs at most a
        fault should it be read again."""
        info = self.tensors[name]
        start, stop, _ = rows.indices(info.rows)
        begin, end = info.offset + start * info.row_bytes, info.offset + stop * info.row_bytes
        try:
            yield self._map[begin:end].reshape(stop - start, info.row_bytes)
        finally:
            first = begin - begin % FOLIO_SPAN
            last = min(-(-end // FOLIO_SPAN) * FOLIO_SPAN, len(self._header))
            self._header.madvise(mmap.MADV_DONTNEED, first, last - first)

    def row_reader(self, name: str) -> TensorRows:
        """Reads of the tensor's rows that outlive this object (on a descriptor of their own)."""
        assert self._fd >= 0, "the file is closed"
        return TensorRows(os.dup(self._fd), self.tensors[name])

    def _parse(self, size: int) -> tuple[dict, dict[str, TensorInfo]]:
        data = self._map
        if bytes(data[:4]) != MAGIC:
            raise UnservableModel("The model file is not a GGUF file (it does not start with GGUF).")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", data, 4)
        if version not in VERSIONS:
            raise UnservableModel(f"The model file is GGUF version {version}; trillm reads versions 2 and 3.")
        pos, metadata = 24, {}
        for _ in range(kv_count):
            key, pos = _string(data, pos)
            (kind,) = struct.unpack_from("<I", data, pos)
            metadata[key], pos = _value(data, pos + 4, kind)
        entries = []
        for _ in range(tensor_count):
            name, pos = _string(data, pos)
            (dims,) = struct.unpack_from("<I", data, pos)
            shape = struct.unpack_from(f"<{dims}Q", data, pos + 4)
            kind, offset = struct.unpack_from("<IQ", data, pos + 4 + 8 * dims)
            pos += 16 + 8 * dims
            entries.append((name, kind, tuple(reversed(shape)), offset))
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        start = -(-pos // alignment) * alignment
        tensors = {}
        for name, kind, shape, offset in entries:
            try:
                kind = GGMLQuantizationType(kind)
            except ValueError:
                raise UnservableModel(f"Tensor {name!r} is in GGML type {kind}, which trillm does not know.") from None
            values, nbytes = GGML_QUANT_SIZES[kind]
            if shape[-1] % values:
                raise UnservableModel(f"Tensor {name!r}'s rows do not fill whole {kind.name} blocks.")
            info = TensorInfo(name, kind, shape, start + offset, prod(shape) // values * nbytes)
            if info.offset + info.nbytes > size:
                raise UnservableModel(f"Tensor {name!r} runs past the end of the model file.")
            tensors[name] = info
        return metadata, tensors


class StringCount(int):
    """An array of strings the header reader skipped (a vocabulary, its merges): its length, and
    where its first string starts in the file (`GGUFFile.strings` reads them)."""

    at: int


def to_float(blocks: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """[rows, bytes of a row] of `kind` -> [rows, values of a row] fp32, as gguf-py dequantizes."""
    if kind == GGMLQuantizationType.F32:
        return blocks.view(np.float32)
    return np.ascontiguousarray(dequantize(blocks, kind), dtype=np.float32)


def _string(data: np.ndarray, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", data, pos)
    end = pos + 8 + length
    if end > len(data):
        raise UnservableModel("The model file's metadata runs past its end.")
    return bytes(data[pos + 8 : end]).decode(), end


def _value(data: np.ndarray, pos: int, kind: int):
    """One metadata value and the position after it. Arrays of numbers are read whole (token
    types, scores, per-layer counts); arrays of strings (the vocabulary, the merges) only
    counted: the tokenizer reads them itself."""
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack_from(fmt, data, pos)[0], pos + struct.calcsize(fmt)
    if kind == _STRING:
        return _string(data, pos)
    if kind != _ARRAY:
        raise UnservableModel(f"The model file's metadata holds a value of unknown type {kind}.")
    item, count = struct.unpack_from("<IQ", data, pos)
    pos += 12
    if item in _SCALARS:
        width = struct.calcsize(_SCALARS[item])
        if pos + count * width > len(data):
            raise UnservableModel("The model file's metadata runs past its end.")
        return list(struct.unpack_from(f"<{count}{_SCALARS[item][1]}", data, pos)), pos + count * width
    if item != _STRING:
        raise UnservableModel(f"The model file's metadata holds an array of type {item}, which trillm cannot read.")
    strings = StringCount(count)
    strings.at = pos
    for _ in range(count):
        (length,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + length
    return strings, pos
