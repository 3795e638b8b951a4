"""Strict safetensors reading and writing for the replay files (public format helpers).

The safetensors library parses headers in Rust and reports problems as ``SafetensorError``
(or, for some malformed files, panics). Replay files come from other machines and other
programs, so this module reads and checks the header itself first, with every rule the
format has (8-byte little-endian header length, a JSON object, known dtypes, shapes that
match their byte ranges, byte ranges that tile the data section exactly) and raises
``ValueError`` naming the field, the value and what is allowed. Only a header that passed
those checks is handed to ``safetensors.safe_open`` for the tensor data.

Writing goes through ``safetensors.torch.save_file`` to a temporary file in the same folder
that is then renamed, so a crash never leaves a half-written file under the final name; the
file gets the umask's permissions (``save_file`` alone writes 0600).
"""

from __future__ import annotations

import json
import math
import os
import re
import uuid
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

__all__ = [
    "SafetensorsHeader",
    "read_header",
    "read_tensors",
    "write_tensors",
    "replace_atomically",
    "parse_int_metadata",
    "check_text_metadata",
    "check_format",
    "check_names",
    "dtype_name",
    "one_line",
]

# safetensors' own limit on the JSON header (a larger one is refused by the Rust reader).
_MAX_HEADER_BYTES = 100_000_000

# dtypes torch can represent; the replay formats use only a few, the callers check which.
_DTYPES = {
    "BOOL": (torch.bool, 1),
    "U8": (torch.uint8, 1),
    "I8": (torch.int8, 1),
    "I16": (torch.int16, 2),
    "I32": (torch.int32, 4),
    "I64": (torch.int64, 8),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "F32": (torch.float32, 4),
    "F64": (torch.float64, 8),
}
# Keeps every size computation far from the 64-bit limits of the Rust reader.
_MAX_DIM = 2**48



@dataclass(frozen=True)
class _TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    """A checked safetensors header: tensor name -> (dtype, shape), and the metadata."""

    path: str
    tensors: dict[str, _TensorInfo]
    metadata: dict[str, str]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self.tensors[name].dtype


def one_line(text: str, limit: int = 80) -> str:
    """A short, single-line rendering of untrusted text for error messages."""
    text = repr(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short_json(value, limit: int = 80) -> str:
    """Compact JSON of an untrusted header value, cut to ``limit`` characters."""
    try:
        text = json.dumps(value)
    except RecursionError:
        return "<deeply nested JSON>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _no_duplicates(pairs):
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"safetensors header: duplicate key {one_line(key)}; allowed: each key once")
        obj[key] = value
    return obj


def _reject_constant(name):
    raise ValueError(f"safetensors header: JSON constant {name}; allowed: plain JSON (no NaN/Infinity)")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_header(path) -> SafetensorsHeader:
    """Read and check the header of a safetensors file, without reading tensor data.

    Raises ``FileNotFoundError`` when ``path`` does not exist and ``ValueError`` for
    anything that is not a complete, well-formed safetensors file.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"file {path!r} does not exist")
    if not os.path.isfile(path):
        raise ValueError(f"file {path!r} is not a regular file; allowed: a safetensors file")
    size = os.path.getsize(path)
    if size < 10:  # the smallest safetensors file: an 8-byte header length and the header "{}"
        raise ValueError(
            f"file {path!r}: {size} bytes is too short for a safetensors file; allowed: at least 10 bytes "
            "(an 8-byte header length, a JSON header of at least 2 bytes, the tensor data)"
        )
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        if header_len < 2 or header_len > min(size - 8, _MAX_HEADER_BYTES):
            raise ValueError(
                f"file {path!r}: safetensors header length {header_len} is impossible for a "
                f"{size}-byte file (allowed: 2 to {min(size - 8, _MAX_HEADER_BYTES)}); "
                "truncated or not a safetensors file"
            )
        raw = f.read(header_len)
    if len(raw) != header_len:
        raise ValueError(f"file {path!r}: header truncated ({len(raw)} of {header_len} bytes)")
    if raw[:1] != b"{":
        raise ValueError(
            f"file {path!r}: safetensors header starts with {raw[:1]!r}; allowed: '{{' (a JSON object)"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"file {path!r}: safetensors header is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        header = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError(f"file {path!r}: safetensors header JSON is nested too deeply") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"file {path!r}: safetensors header is not valid JSON ({exc.msg} at char {exc.pos})") from None
    except ValueError as exc:
        raise ValueError(f"file {path!r}: {exc}") from None
    if not isinstance(header, dict):
        raise ValueError(f"file {path!r}: safetensors header is {type(header).__name__}; allowed: a JSON object")

    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise ValueError(
            f"file {path!r}: __metadata__ is {_short_json(metadata)}; "
            "allowed: an object of string keys and string values"
        )

    tensors: dict[str, _TensorInfo] = {}
    for name, info in header.items():
        where = f"file {path!r}: tensor {one_line(name)}"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(
                f"{where}: entry {_short_json(info)}; allowed: an object with exactly "
                "'dtype', 'shape' and 'data_offsets'"
            )
        dtype_name, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype_name, str) or dtype_name not in _DTYPES:
            raise ValueError(
                f"{where}: dtype {_short_json(dtype_name)}; allowed: one of {sorted(_DTYPES)}"
            )
        if not isinstance(shape, list) or not all(_is_int(d) and 0 <= d <= _MAX_DIM for d in shape):
            raise ValueError(
                f"{where}: shape {_short_json(shape)}; allowed: a list of integers in [0, 2**48]"
            )
        data_len = size - 8 - header_len
        pair = isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) and o >= 0 for o in offsets)
        if not pair or offsets[0] > offsets[1] or offsets[1] > size:  # a smaller overrun: the tiling check below
            cut = pair and offsets[0] <= offsets[1] and offsets[1] > data_len  # the usual cause: a partial copy
            raise ValueError(
                f"{where}: data_offsets {_short_json(offsets)}; allowed: [begin, end] "
                f"with 0 <= begin <= end <= {data_len}"
                + (f"; the file is cut short (a partial copy or download?): its data holds {data_len:,} bytes, "
                   f"this tensor ends at byte {offsets[1]:,}" if cut else "")
            )
        dtype, itemsize = _DTYPES[dtype_name]
        nbytes = math.prod(shape) * itemsize
        if nbytes != offsets[1] - offsets[0]:
            raise ValueError(
                f"{where}: shape {shape} of {dtype_name} needs {nbytes} bytes but data_offsets "
                f"{offsets} span {offsets[1] - offsets[0]}; allowed: matching sizes"
            )
        tensors[name] = _TensorInfo(dtype, tuple(shape), offsets[0], offsets[1])

    # The byte ranges must tile the data section exactly: no gaps, no overlaps, no tail.
    data_len = size - 8 - header_len
    position = 0
    for name, info in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if info.begin != position:
            raise ValueError(
                f"file {path!r}: tensor {one_line(name)} starts at data byte {info.begin}; "
                f"allowed: {position} (tensors must be contiguous)"
            )
        position = info.end
    if position != data_len:
        raise ValueError(
            f"file {path!r}: tensors cover {position} data bytes but the file has {data_len}; "
            "truncated or extended file"
        )
    return SafetensorsHeader(path=path, tensors=tensors, metadata=dict(metadata))


def read_tensors(header: SafetensorsHeader, names) -> dict[str, torch.Tensor]:
    """Load the named tensors of a file whose header :func:`read_header` checked."""
    out = {}
    try:
        with safe_open(header.path, framework="pt") as f:
            for name in names:
                out[name] = f.get_tensor(name)
    except SafetensorError as exc:
        # read_header mirrors the Rust checks; this is the net for any rule it missed.
        raise ValueError(f"file {header.path!r}: safetensors refused the file ({' '.join(str(exc).split())})") from None
    for name, tensor in out.items():
        info = header.tensors[name]
        if tensor.dtype != info.dtype or tuple(tensor.shape) != info.shape:
            raise ValueError(
                f"file {header.path!r}: tensor {name!r} was read as {tensor.dtype} {tuple(tensor.shape)}, "
                f"header says {info.dtype} {info.shape} (file changed while reading?)"
            )
    return out


def write_tensors(path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write tensors and metadata to ``path`` atomically (:func:`replace_atomically`)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):  # else the error would name the temporary file below
        raise FileNotFoundError(f"cannot write {path!r}: the folder {folder!r} does not exist; create it first")
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    replace_atomically(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def replace_atomically(path: str, write) -> None:
    """``write(tmp)`` fills a fresh file in ``path``'s folder, which then replaces ``path`` by
    a rename: a failed or interrupted write never leaves half a file, and the file that was
    there stays until the new one is whole.

    The file gets the mode a new file gets there (the umask's, read off the placeholder
    created first): safetensors' ``save_file`` writes 0600 whatever the umask, so without
    this other users of a shared cluster could not read it. Any exception removes the
    temporary file and propagates.
    """
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        try:
            mode = os.fstat(fd).st_mode & 0o777
        finally:
            os.close(fd)
        write(tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


_INT_RE = re.compile(r"(0|[1-9][0-9]{0,17})\Z")


def parse_int_metadata(metadata: dict[str, str], key: str, where: str, lo: int, hi: int) -> int:
    """Parse ``metadata[key]`` as a decimal integer in ``[lo, hi]`` or raise ``ValueError``."""
    if key not in metadata:
        raise ValueError(f"{where}: metadata {key!r} is missing; allowed: a decimal integer in [{lo}, {hi}]")
    text = metadata[key]
    if not _INT_RE.match(text):
        raise ValueError(
            f"{where}: metadata {key} = {one_line(text)} is not a decimal integer; "
            f"allowed: an integer in [{lo}, {hi}]"
        )
    value = int(text)
    if not lo <= value <= hi:
        raise ValueError(f"{where}: metadata {key} = {value}; allowed: an integer in [{lo}, {hi}]")
    return value


def check_text_metadata(value: str, key: str, where: str, max_len: int = 256) -> str:
    """Free-text metadata (e.g. a model name): printable, one line, at most ``max_len`` chars."""
    if not isinstance(value, str):
        raise TypeError(f"{where}: {key} is {type(value).__name__}; allowed: str")
    if len(value) > max_len or not value.isprintable():
        raise ValueError(
            f"{where}: {key} = {one_line(value)}; allowed: printable one-line text of at most {max_len} characters"
        )
    return value


def check_format(metadata: dict[str, str], expected: str, where: str) -> None:
    """Raise ``ValueError`` unless ``metadata["format"] == expected``."""
    if "format" not in metadata:
        raise ValueError(f"{where}: metadata 'format' is missing; allowed: {expected!r}")
    if metadata["format"] != expected:
        raise ValueError(f"{where}: metadata format = {one_line(metadata['format'])}; allowed: {expected!r}")


def check_names(found, required, optional, kind: str, where: str) -> None:
    """Raise ``ValueError`` when a required ``kind`` (metadata key, tensor) is missing from
    ``found`` or an unknown one is present: the formats allow nothing else."""
    found = set(found)
    missing = [k for k in required if k not in found]
    if missing:
        raise ValueError(f"{where}: {kind} {missing[0]!r} is missing; required: {list(required)}")
    unknown = sorted(found - set(required) - set(optional))
    if unknown:
        raise ValueError(
            f"{where}: unknown {kind} {one_line(unknown[0])}; allowed: {list(required) + list(optional)}"
        )


def dtype_name(dtype: torch.dtype) -> str:
    """``int16`` for ``torch.int16`` (error messages)."""
    return str(dtype).replace("torch.", "")
