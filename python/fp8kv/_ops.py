"""Loads fp8kv's compiled operators and registers their fake (meta) kernels.

The ops mutate preallocated outputs and return nothing, so each fake kernel only has to exist:
shapes of the outputs are the caller's. Validation lives in the C++ bindings, in one place.
"""

from __future__ import annotations

import pathlib

import torch

from . import __path__ as _package_dirs

_LIBRARY_NAME = "libfp8kv_ops.so"


def _find_library() -> pathlib.Path:
    # The package may span several directories (an editable install keeps the sources apart from
    # the built library).
    for directory in _package_dirs:
        candidate = pathlib.Path(directory) / _LIBRARY_NAME
        if candidate.exists():
            return candidate
    raise ImportError(
        f"fp8kv: compiled library {_LIBRARY_NAME} not found in {list(_package_dirs)}; install the "
        "package with `pip install --no-build-isolation .` from the source tree"
    )


LIBRARY_PATH = _find_library()
torch.ops.load_library(str(LIBRARY_PATH))


@torch.library.register_fake("fp8kv::reshape_and_cache")
def _reshape_and_cache_fake(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale) -> None:
    return None


@torch.library.register_fake("fp8kv::paged_attention")
def _paged_attention_fake(
    out, query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, softmax_scale,
    k_scale, v_scale, sliding_window=-1, logits_soft_cap=0.0,
) -> None:
    return None


@torch.library.register_fake("fp8kv::kv_amax")
def _kv_amax_fake(key, value, k_amax, v_amax) -> None:
    return None


def has_cuda_kernels() -> bool:
    """True when the library was built with its CUDA kernels."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("fp8kv::paged_attention", "CUDA")
