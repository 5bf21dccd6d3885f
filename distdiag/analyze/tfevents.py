"""A small reader of TensorBoard event files, without tensorboard or protobuf installed.

An event file is a TFRecord stream: each record is
    uint64 length | uint32 masked CRC32C(length) | length bytes | uint32 masked CRC32C(bytes)
and each record's bytes are an `Event` protobuf. We decode just the fields scalars live in:
    Event:   1 wall_time (double), 2 step (int64), 5 summary (Summary)
    Summary: 1 value (repeated Value)
    Value:   1 tag (string), 2 simple_value (float), 8 tensor (TensorProto)
    TensorProto: 1 dtype, 4 tensor_content, 5 float_val, 6 double_val, 7 int_val, 10 int64_val
`simple_value` is what torch.utils.tensorboard's add_scalar writes; TF2's tf.summary.scalar
writes a one-element tensor. Images, histograms and graphs are skipped.

The checksums use the C `google-crc32c` when it is installed (`pip install
'distdiag[crc32c]'`: hundreds of MB/s), else the table-driven Python below (about 5 MB/s: a
1 GB event file takes minutes). Both give the same values (tests/unit/test_analyze_readers.py).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

from distdiag.analyze.series import Run
from distdiag.analyze.values import LogFormatError, read_log

__all__ = ["read_tfevents", "iter_records", "crc32c", "crc32c_python", "crc32c_implementation", "masked_crc"]

_CRC_TABLE: list[int] = []


def _table() -> list[int]:
    if not _CRC_TABLE:
        for i in range(256):
            crc = i
            for _ in range(8):
                crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
            _CRC_TABLE.append(crc)
    return _CRC_TABLE


def crc32c_python(data: bytes) -> int:
    """CRC32C (Castagnoli) in pure Python: the fallback without google-crc32c."""
    table = _table()
    crc = 0xFFFFFFFF
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _c_crc32c() -> Callable[[bytes], int] | None:
    """google-crc32c's C function, or None (not installed, or only its own Python fallback)."""
    try:
        import google_crc32c
    except ImportError:
        return None
    if getattr(google_crc32c, "implementation", "c") != "c":
        return None
    return lambda data: int(google_crc32c.value(bytes(data)))


_FAST: list[Callable[[bytes], int] | None] = []


def crc32c_implementation() -> str:
    """'c' when google-crc32c's C extension computes the checksums, else 'python'."""
    if not _FAST:
        _FAST.append(_c_crc32c())
    return "c" if _FAST[0] is not None else "python"


def crc32c(data: bytes) -> int:
    """CRC32C of `data`: google-crc32c's C code when installed, else crc32c_python."""
    crc32c_implementation()
    fast = _FAST[0]
    return fast(data) if fast is not None else crc32c_python(data)


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _truncated(path: Path, index: int, pos: int, detail: str, strict: bool, notes: list[str]) -> None:
    """A cut last record: an error when strict, else a note (the writer stopped mid-record)."""
    if strict:
        raise LogFormatError(f"{path}: truncated record {index} at byte {pos} ({detail})")
    notes.append(f"{path}: skipped a truncated last record {index} (the writer stopped mid-record)")


def iter_records(blob: bytes, path: Path, *, strict: bool, notes: list[str]):
    """Yield each record's payload; a cut or corrupt record raises, except a cut last one."""
    pos, n, index = 0, len(blob), 0
    while pos < n:
        if n - pos < 12:
            _truncated(path, index, pos, f"{n - pos} bytes of a 12-byte header", strict, notes)
            return
        header = blob[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", blob[pos + 8 : pos + 12])
        if masked_crc(header) != length_crc:
            raise LogFormatError(f"{path}: record {index} at byte {pos} has a bad length checksum: not an event file, or corrupt")
        end = pos + 12 + length + 4
        if end > n:
            _truncated(path, index, pos, f"{n - pos} of {end - pos} bytes", strict, notes)
            return
        payload = blob[pos + 12 : pos + 12 + length]
        (data_crc,) = struct.unpack("<I", blob[end - 4 : end])
        if masked_crc(payload) != data_crc:
            raise LogFormatError(f"{path}: record {index} at byte {pos} has a bad data checksum: the file is corrupt")
        yield payload
        pos, index = end, index + 1


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("varint runs past the end of the message")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def _fields(buf: bytes):
    """Yield (field number, wire type, value) of a protobuf message; value is int or bytes."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        num, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos : pos + 8], pos + 8
        elif wire == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos : pos + size], pos + size
        elif wire == 5:
            value, pos = buf[pos : pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if pos > len(buf):
            raise ValueError("field runs past the end of the message")
        yield num, wire, value


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _tensor_scalar(buf: bytes) -> float | None:
    dtype, content = 0, b""
    values: list[float] = []
    for num, wire, value in _fields(buf):
        if num == 1 and wire == 0:
            dtype = value
        elif num == 4 and wire == 2:
            content = value
        elif num == 5:  # float_val, packed or not
            values += [x for (x,) in struct.iter_unpack("<f", value)]
        elif num == 6:
            values += [x for (x,) in struct.iter_unpack("<d", value)]
        elif num in (7, 10) and wire == 0:
            values.append(float(_signed64(value)))
        elif num in (7, 10) and wire == 2:
            pos = 0
            while pos < len(value):
                v, pos = _varint(value, pos)
                values.append(float(_signed64(v)))
    if content:
        fmt = {1: "<f", 2: "<d", 3: "<i", 9: "<q"}.get(dtype)
        if fmt is None or len(content) != struct.calcsize(fmt):
            return None  # not a scalar (a histogram, an image, a string)
        return float(struct.unpack(fmt, content)[0])
    return values[0] if len(values) == 1 else None


def _parse_event(payload: bytes, run: Run) -> None:
    step = 0
    values: list[tuple[str, float]] = []
    for num, wire, value in _fields(payload):
        if num == 2 and wire == 0:
            step = _signed64(value)
        elif num == 5 and wire == 2:
            for snum, swire, sval in _fields(value):
                if snum != 1 or swire != 2:
                    continue
                tag, scalar = None, None
                for vnum, vwire, vval in _fields(sval):
                    if vnum == 1 and vwire == 2:
                        tag = vval.decode("utf-8", "replace")
                    elif vnum == 2 and vwire == 5:
                        scalar = struct.unpack("<f", vval)[0]
                    elif vnum == 8 and vwire == 2:
                        scalar = _tensor_scalar(vval)
                if tag is not None and scalar is not None:
                    values.append((tag, float(scalar)))
    for tag, scalar in values:
        run.add(tag, step, scalar)


def read_tfevents(files: list[Path], *, strict: bool = False, label: str, source: str) -> Run:
    run = Run(label=label, source=source)
    for path in files:
        blob = read_log(path, "a TensorBoard event file")
        if not blob:
            run.notes.append(f"{path}: empty event file skipped")
            continue
        for index, payload in enumerate(iter_records(blob, path, strict=strict, notes=run.notes)):
            try:
                _parse_event(payload, run)
            except (ValueError, struct.error, UnicodeDecodeError) as exc:
                raise LogFormatError(f"{path}: record {index} is not a TensorBoard event ({exc})") from None
    run.finish()
    return run
