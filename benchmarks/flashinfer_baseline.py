"""FlashInfer's FP8 paged attention, isolated so that a missing or broken FlashInfer only disables
its benchmark columns, with the exact reason, and never stops the run.

FlashInfer is optional: `pip install flashinfer-python` where the network allows (it JIT-compiles
each kernel at first use), or the trimmed wheel that benchmarks/flashinfer_wheel.py builds with the
kernels used here compiled ahead of time for sm_90a (bf16 or e4m3 query over an e4m3 cache, bf16
output, head sizes 64/128/256, no RoPE / window / soft cap), for machines without network. JIT output
goes under /tmp/flashinfer-workspace (FLASHINFER_WORKSPACE_BASE).

Used here:
- decode: BatchDecodeWithPagedKVCacheWrapper, backend "fa2", with its CUDA-core decode kernel
  (use_tensor_cores=False) and with its tensor-core kernel (use_tensor_cores=True);
- prefill / chunked prefill / speculative verification: BatchPrefillWithPagedKVCacheWrapper, causal
  (FlashInfer aligns the causal mask to the end of the cache, like fp8kv), with backend "fa2" and the
  bf16 query, and with backend "fa3", its Hopper kernel with FP8 math, which takes an FP8 cache only
  with an FP8 query: the bf16 query is quantized to e4m3 with a scale per head (amax / 448) inside
  the timed call, as a caller holding bf16 queries pays it.
FA2: k_scale / v_scale are passed as Python floats: FlashInfer folds k_scale into the softmax scale
and multiplies the output by v_scale after the kernel (that multiply is part of its timed call).
FA3 FP8: the query's per-head scales (a float32 tensor) and k_scale / v_scale (floats) go to run() as
positional arguments, FlashInfer's way of handing them to the kernel, which applies all three inside
(it also scales P by 448 into e4m3 for the PV product and divides it out at the end).

Run directly for a smoke test on the GPU: `python benchmarks/flashinfer_baseline.py`.
"""

from __future__ import annotations

import os
import time
import types

import torch

WORKSPACE_BASE = "/tmp/flashinfer-workspace"
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace for split-KV partials
FP8_QUERY_DTYPE = torch.float8_e4m3fn


def load() -> tuple[types.ModuleType | None, str]:
    """(flashinfer module, description) when usable, else (None, why not)."""
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", WORKSPACE_BASE)
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    try:
        import flashinfer
    except Exception as exc:  # any import failure only disables the column; say which
        return None, f"import flashinfer failed: {type(exc).__name__}: {exc}"
    return flashinfer, f"flashinfer {flashinfer.__version__} from {os.path.dirname(flashinfer.__file__)}"


def paged_kv_indices(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int):
    """FlashInfer's CSR page description (indptr, indices, last_page_len) of a block table.

    block_tables: int32 [num_seqs, max_blocks]; sequence i uses its first ceil(seq_len / block_size)
    entries, in order.
    """
    pages = (seq_lens.long() + block_size - 1) // block_size
    indptr = torch.zeros(len(pages) + 1, dtype=torch.int32, device=block_tables.device)
    indptr[1:] = torch.cumsum(pages, 0).to(torch.int32)
    used = torch.arange(block_tables.shape[1], device=block_tables.device)[None, :] < pages[:, None]
    indices = block_tables[used].to(torch.int32)
    last_page_len = (seq_lens.long() - (pages - 1).clamp(min=0) * block_size).to(torch.int32)
    return indptr, indices, last_page_len


def quantize_per_head(query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes of a [tokens, heads, dim] query and their float32 scale per head (amax / 448):
    query ~ codes * scale[head]. Two passes over the query: its maxima, then one float32 division
    that rounds to e4m3 as it stores (a quotient above 448 by float32 rounding rounds back to 448)."""
    amax = torch.linalg.vector_norm(query, float("inf"), dim=(0, 2), dtype=torch.float32)
    scale = (amax / torch.finfo(FP8_QUERY_DTYPE).max).clamp_min(torch.finfo(torch.float32).tiny)  # a zero head: codes 0
    codes = torch.empty(query.shape, dtype=FP8_QUERY_DTYPE, device=query.device)
    torch.div(query, scale[:, None], out=codes)
    return codes, scale


def _layout_tensors(key_cache: torch.Tensor, value_cache: torch.Tensor, kv_layout: str):
    """The physical cache tensors FlashInfer expects, from fp8kv's logical [blocks, block, heads, dim]
    views: NHD storage is passed as is, HND storage as its permuted (contiguous) allocation."""
    if kv_layout == "NHD":
        tensors = (key_cache, value_cache)
    elif kv_layout == "HND":
        tensors = (key_cache.permute(0, 2, 1, 3), value_cache.permute(0, 2, 1, 3))
    else:
        raise ValueError(f"kv_layout: expected 'NHD' or 'HND', got {kv_layout!r}")
    for name, tensor in zip(("key_cache", "value_cache"), tensors):
        if not tensor.is_contiguous():
            raise ValueError(f"{name}: a contiguous {kv_layout} allocation is needed for FlashInfer")
    return tensors


class _Wrapped:
    """A planned FlashInfer call; calling it runs the attention into a preallocated output."""

    setup_seconds: float

    def __call__(self) -> torch.Tensor:
        return self._run()


class Decode(_Wrapped):
    def __init__(self, flashinfer, *, query, key_cache, value_cache, kv_layout, block_tables, seq_lens,
                 softmax_scale: float, k_scale: float, v_scale: float, use_tensor_cores: bool):
        start = time.perf_counter()
        _, block_size, num_kv_heads, head_size = key_cache.shape
        caches = _layout_tensors(key_cache, value_cache, kv_layout)
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=query.device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, kv_layout=kv_layout, use_tensor_cores=use_tensor_cores, backend="fa2")
        indptr, indices, last_page_len = paged_kv_indices(block_tables, seq_lens, block_size)
        wrapper.plan(indptr, indices, last_page_len, query.shape[1], num_kv_heads, head_size, block_size,
                     q_data_type=query.dtype, kv_data_type=key_cache.dtype, o_data_type=query.dtype,
                     sm_scale=softmax_scale)
        out = torch.empty_like(query)
        self._run = lambda: wrapper.run(query, caches, k_scale=k_scale, v_scale=v_scale, out=out)
        self._run()  # the first run builds or loads the kernel module
        torch.cuda.synchronize()
        self.setup_seconds = time.perf_counter() - start


class Prefill(_Wrapped):
    """FA2 with the bf16 query, or (fp8_query=True) FA3 with the query quantized to e4m3 per head in
    each call; bf16 output either way."""

    def __init__(self, flashinfer, *, query, key_cache, value_cache, kv_layout, block_tables, seq_lens,
                 cu_seqlens_q, softmax_scale: float, k_scale: float, v_scale: float, fp8_query: bool = False):
        start = time.perf_counter()
        _, block_size, num_kv_heads, head_size = key_cache.shape
        caches = _layout_tensors(key_cache, value_cache, kv_layout)
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=query.device)
        backend, q_data_type = ("fa3", FP8_QUERY_DTYPE) if fp8_query else ("fa2", query.dtype)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout=kv_layout, backend=backend)
        indptr, indices, last_page_len = paged_kv_indices(block_tables, seq_lens, block_size)
        wrapper.plan(cu_seqlens_q.to(torch.int32), indptr, indices, last_page_len, query.shape[1], num_kv_heads,
                     head_size, block_size, causal=True, sm_scale=softmax_scale,
                     q_data_type=q_data_type, kv_data_type=key_cache.dtype, o_data_type=query.dtype)
        out = torch.empty_like(query)
        if fp8_query:
            def run():
                codes, q_scale = quantize_per_head(query)
                return wrapper.run(codes, caches, q_scale, k_scale, v_scale, out=out)
            self._run = run
        else:
            self._run = lambda: wrapper.run(query, caches, k_scale=k_scale, v_scale=v_scale, out=out)
        self._run()
        torch.cuda.synchronize()
        self.setup_seconds = time.perf_counter() - start


def _smoke_test() -> None:
    """One small decode (both kernels) and prefill (FA2, FA3 FP8) per storage, checked against float32
    attention."""
    import attention_cases as cases  # benchmarks/ is on sys.path when this file runs as a script

    flashinfer, description = load()
    print(description)
    if flashinfer is None:
        raise SystemExit(1)
    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(0)
    batch, context, num_heads, num_kv_heads, head_size, block_size = 4, 1000, 32, 8, 128, 16
    cache = cases.make_paged_cache(batch, context, num_kv_heads, head_size, block_size, gen, device)
    key = cases.gather_dequantize(cache.key_nhd, cache.block_tables, context, cache.k_scale)
    value = cases.gather_dequantize(cache.value_nhd, cache.block_tables, context, cache.v_scale)
    softmax_scale = head_size**-0.5
    for q_len in (1, 7):
        query = cases.random_query(batch * q_len, num_heads, head_size, gen, device)
        batched = lambda rows: rows.view(batch, q_len, num_heads, head_size).transpose(1, 2)
        ref = cases.reference_attention(batched(query), key, value, softmax_scale)
        for layout in ("NHD", "HND"):
            common = dict(query=query, key_cache=cache.layout(layout)[0], value_cache=cache.layout(layout)[1],
                          kv_layout=layout, block_tables=cache.block_tables, seq_lens=cache.seq_lens,
                          softmax_scale=softmax_scale, k_scale=cases.K_SCALE, v_scale=cases.V_SCALE)
            cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=device) * q_len
            runs = {"prefill": Prefill(flashinfer, cu_seqlens_q=cu_seqlens_q, **common),
                    "prefill FA3 FP8": Prefill(flashinfer, cu_seqlens_q=cu_seqlens_q, fp8_query=True, **common)}
            if q_len == 1:
                runs["decode cuda-core"] = Decode(flashinfer, use_tensor_cores=False, **common)
                runs["decode tensor-core"] = Decode(flashinfer, use_tensor_cores=True, **common)
            for name, run in runs.items():
                out = batched(run()).float()
                err = float((out - ref).norm() / ref.norm())
                print(f"q_len {q_len} {layout} {name:18s} setup {run.setup_seconds:6.2f} s  "
                      f"relative error vs float32 {err:.2e}")


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description="FlashInfer smoke test on the GPU: " + _smoke_test.__doc__).parse_args()
    _smoke_test()
