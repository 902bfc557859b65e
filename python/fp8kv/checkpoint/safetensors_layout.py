"""Whether a safetensors header describes its file's data: each tensor's dtype, shape and offsets
agree, and the tensors tile the data from its first byte to the end of the file, as the safetensors
loader requires (it refuses the whole file otherwise). A truncated copy, or a header that lies about
its sizes, is found here from the header and the file size, before any tensor is read."""

from __future__ import annotations

from .values import is_int, lookup, show

# Bits per element of each safetensors dtype (the names its loader accepts).
DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}
METADATA = "__metadata__"


def layout_problem(entries: dict, data_start: int, data_size: int) -> tuple[str | None, str] | None:
    """(the tensor or field, or None for the whole file; what is wrong) for the first way header
    `entries` does not describe data of `data_size` bytes at file offset `data_start`; None if it does."""
    metadata = entries.get(METADATA)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        return METADATA, "must be an object of strings"
    spans = []
    for name, entry in entries.items():
        if name == METADATA:
            continue
        if not isinstance(entry, dict):
            return name, f"must be an object of dtype, shape and data_offsets, got {show(entry)}"
        offsets = entry.get("data_offsets")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(o) and o >= 0 for o in offsets)
                and offsets[0] <= offsets[1]):
            return name, f"data_offsets must be [begin, end], integers with 0 <= begin <= end, got {show(offsets)}"
        problem = _size_problem(entry.get("dtype"), entry.get("shape"), offsets[1] - offsets[0])
        if problem:
            return name, problem
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            return name, (f"data_offsets start at byte {begin}, where the tensor before ends at {end}: the tensors "
                          "must fill the data without gaps or overlaps")
        end = stop
    if end != data_size:
        described, size = data_start + end, data_start + data_size
        if end > data_size:
            return None, f"truncated: the file has {size} bytes, its header describes {described}"
        return None, f"the file has {size} bytes, its header describes {described}: {size - described} bytes follow"
    return None


def _size_problem(dtype, shape, nbytes: int) -> str | None:
    bits = lookup(DTYPE_BITS, dtype)
    if bits is None:
        return f"dtype {show(dtype)} is none of the safetensors dtypes ({', '.join(DTYPE_BITS)})"
    if not (isinstance(shape, list) and all(is_int(n) and n >= 0 for n in shape)):
        return f"shape must be a list of non-negative integers, got {show(shape)}"
    elements = 0 if 0 in shape else 1
    for n in shape:  # capped: a hostile shape's product costs no more than its length
        elements = min(elements * n, _MAX_ELEMENTS)
    if elements * bits == 8 * nbytes:
        return None
    takes = "more than 2^64 elements" if elements == _MAX_ELEMENTS else f"{elements * bits / 8:.15g} bytes"
    return f"data_offsets hold {nbytes} bytes, where {dtype} of shape {show(shape)} takes {takes}"


_MAX_ELEMENTS = 2**64
