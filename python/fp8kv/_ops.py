"""Loads fp8kv's compiled operators and registers their fake (meta) kernels.

The ops mutate preallocated outputs and return nothing, so a fake kernel computes nothing: shapes of
the outputs are the caller's, and validation lives in the C++ bindings, in one place. The fakes only
refuse mixed devices, which would otherwise route a real call to them.
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


def _check_one_device(op: str, **tensors) -> None:
    """A fake kernel runs for meta tensors and while tracing; a real tensor among meta ones would skip
    every check and write nothing, so mixed devices are refused here as the real kernels refuse them."""
    present = {name: t for name, t in tensors.items() if t is not None}
    # The reference is a tensor off the meta device where there is one, so the message names the meta one.
    ref_name, ref = next(((n, t) for n, t in present.items() if t.device.type != "meta"), next(iter(present.items())))
    for name, t in present.items():
        if t.device != ref.device:
            raise RuntimeError(f"{op}: `{name}` must be on {ref.device} like `{ref_name}`, got {t.device}")


@torch.library.register_fake("fp8kv::reshape_and_cache")
def _reshape_and_cache_fake(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, hadamard=False,
                            k_offset=None) -> None:
    _check_one_device("fp8kv.reshape_and_cache", key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                      slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale, k_offset=k_offset)


@torch.library.register_fake("fp8kv::paged_attention")
def _paged_attention_fake(
    out, query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, softmax_scale,
    k_scale, v_scale, sliding_window=-1, logits_soft_cap=0.0, hadamard=False, k_offset=None, fp8_math=False,
    lse=None, plan=None, workspace=None,
) -> None:
    _check_one_device("fp8kv.paged_attention", query=query, out=out, key_cache=key_cache, value_cache=value_cache,
                      block_tables=block_tables, seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q, k_scale=k_scale,
                      v_scale=v_scale, k_offset=k_offset, lse=lse, workspace=workspace)


@torch.library.register_fake("fp8kv::plan_paged_attention")
def _plan_paged_attention_fake(key_cache, block_tables, cu_seqlens_q, num_query_tokens, num_heads, sliding_window=-1,
                               fp8_math=False, lse=False, kernel="auto"):
    # A plan's values come from the device's facts and the kernels' occupancy, which tracing has not.
    raise RuntimeError("fp8kv.plan_paged_attention: plans are made from real tensors outside traced and compiled code "
                       "(once per step, before the layers run); traced code calls paged_attention without a plan, "
                       "and it plans each call itself")


@torch.library.register_fake("fp8kv::merge_attention_states")
def _merge_attention_states_fake(out, lse, out_a, lse_a, out_b, lse_b) -> None:
    _check_one_device("fp8kv.merge_attention_states", out_a=out_a, out=out, lse=lse, lse_a=lse_a, out_b=out_b,
                      lse_b=lse_b)


@torch.library.register_fake("fp8kv::kv_amax")
def _kv_amax_fake(key, value, k_amax, v_amax) -> None:
    _check_one_device("fp8kv.kv_amax", key=key, value=value, k_amax=k_amax, v_amax=v_amax)


@torch.library.register_fake("fp8kv::check_cache_write_indices")
def _check_cache_write_indices_fake(slot_mapping, key_cache) -> None:
    return None  # needs the index values: nothing to check while tracing


@torch.library.register_fake("fp8kv::check_paged_attention_indices")
def _check_paged_attention_indices_fake(block_tables, seq_lens, cu_seqlens_q, num_query_tokens, key_cache,
                                        sliding_window=-1) -> None:
    return None  # needs the index values: nothing to check while tracing


def supported_values(name: str) -> tuple[int, ...]:
    """One of the kernels' lists of supported values, as the library holds them (csrc/dispatch.h):
    "cuda_head_sizes", "cuda_block_sizes", "cuda_sm90a_head_sizes" (the warpgroup-MMA multi-token
    kernel's), "cuda_sm90a_fp8_math_head_sizes" (its FP8-math variant's, `fp8_math`),
    "cuda_sm90a_capability" (the compute capability that kernel runs on) or
    "cuda_decode_table_seqs" (the most sequences of a multi-token call the decode kernel takes)."""
    return tuple(torch.ops.fp8kv.supported_values(name))


def has_cuda_kernels() -> bool:
    """True when the library was built with its CUDA kernels."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("fp8kv::paged_attention", "CUDA")
