"""GGUF files as their raw parts, to build hostile copies of a valid one: every metadata value with its
GGUF value type, every tensor's info as written (dimensions innermost first, ggml type, offset), and
the data section's bytes. Written here from the format's description (GGUF v3, little-endian), apart
from glasslm's reader, so that the tests can write what no writer would (a zero alignment, a float
block count, dimensions whose byte count overflows, an offset past the end) and see the reader's answer.

Example:
    >>> raw = RawGGUF(3, [("general.architecture", STRING, "llama")], [], b"")
    >>> parse(raw.to_bytes()).values["general.architecture"]
    'llama'
"""

from __future__ import annotations

import dataclasses
import struct

# GGUF value types
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
FORMATS = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i", FLOAT32: "<f",
           BOOL: "<?", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}


@dataclasses.dataclass
class TensorInfo:
    name: str
    dims: list[int]  # innermost first, as the file writes them
    ggml_type: int
    offset: int  # from the start of the data section


@dataclasses.dataclass
class RawGGUF:
    version: int
    kv: list[tuple[str, int, object]]  # (key, value type, value); an array's value is (item type, [items])
    tensors: list[TensorInfo]
    data: bytes  # the data section, after the padding
    alignment: int = 32  # where the data section starts (the writer pads to it; None: no padding)

    @property
    def values(self) -> dict[str, object]:
        return {key: value for key, _, value in self.kv}

    def set(self, key: str, kind: int, value: object) -> None:
        """Replace (or add) one metadata entry."""
        self.kv = [entry for entry in self.kv if entry[0] != key] + [(key, kind, value)]

    def drop(self, key: str) -> None:
        self.kv = [entry for entry in self.kv if entry[0] != key]

    def tensor(self, name: str) -> TensorInfo:
        return next(t for t in self.tensors if t.name == name)

    def to_bytes(self) -> bytes:
        out = bytearray(b"GGUF" + struct.pack("<IQQ", self.version, len(self.tensors), len(self.kv)))
        for key, kind, value in self.kv:
            out += _string(key) + struct.pack("<I", kind) + _value(kind, value)
        for t in self.tensors:
            out += _string(t.name) + struct.pack("<I", len(t.dims)) + b"".join(struct.pack("<Q", d) for d in t.dims)
            out += struct.pack("<IQ", t.ggml_type, t.offset)
        if self.alignment:
            out += b"\0" * (-len(out) % self.alignment)
        return bytes(out + self.data)


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _value(kind: int, value: object) -> bytes:
    if kind == STRING:
        return _string(value)
    if kind == ARRAY:
        item_kind, items = value
        return struct.pack("<IQ", item_kind, len(items)) + b"".join(_value(item_kind, item) for item in items)
    return struct.pack(FORMATS[kind], value)


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def take(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        self.at += n
        return self.data[self.at - n:self.at].decode()

    def value(self, kind: int):
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item_kind, n = self.take("<I"), self.take("<Q")
            return item_kind, [self.value(item_kind) for _ in range(n)]
        return self.take(FORMATS[kind])


def parse(data: bytes) -> RawGGUF:
    """A valid GGUF file's parts (for building mutated copies; not for hostile input)."""
    assert data[:4] == b"GGUF"
    r = _Reader(data)
    r.at = 4
    version, n_tensors, n_kv = r.take("<I"), r.take("<Q"), r.take("<Q")
    kv = []
    for _ in range(n_kv):
        key, kind = r.string(), None
        kind = r.take("<I")
        kv.append((key, kind, r.value(kind)))
    tensors = []
    for _ in range(n_tensors):
        name = r.string()
        dims = [r.take("<Q") for _ in range(r.take("<I"))]
        tensors.append(TensorInfo(name, dims, r.take("<I"), r.take("<Q")))
    alignment = dict((k, v) for k, _, v in kv).get("general.alignment", 32)
    start = -(-r.at // alignment) * alignment
    return RawGGUF(version, kv, tensors, data[start:], alignment)
