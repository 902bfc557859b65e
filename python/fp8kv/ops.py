"""Typed wrappers over fp8kv's operators (`torch.ops.fp8kv.*`).

The cache write and attention take one `KVCacheLayer` (fp8kv.layer): a layer's key and value caches
with the format, recipe and scales they hold, so a cache is always read with the recipe it was
written with. The raw operators take the same values as separate arguments, for engines, CUDA graphs
and torch.compile (docs/ops.md).

Every op writes into tensors the caller allocated, runs on the current stream, never synchronizes
with the host and can be captured in a CUDA graph. The tensor layouts are those of
docs/ops.md; bad input raises RuntimeError naming the argument, and a tensor argument given as
something else (a list, a float) TypeError saying what it must be.
"""

import dataclasses

import torch

from . import _ops  # noqa: F401  (loads the library)
from .layer import KVCacheLayer

__all__ = sorted(["reshape_and_cache", "paged_attention", "plan_paged_attention", "AttentionPlan", "kv_amax",
                  "check_cache_write_indices", "check_paged_attention_indices", "merge_attention_states"])


def __dir__() -> list[str]:
    # The module's imports are not part of its interface.
    return __all__


# What each argument must be, for the TypeError of a call that passes something else: the op's own
# schema error lists the whole signature instead of naming the argument.
_TENSORS = {
    "key": "a tensor [num_tokens, num_kv_heads, head_size]",
    "value": "a tensor [num_tokens, num_kv_heads, head_size]",
    "layer": "a KVCacheLayer (PagedKVCache.layer(index))",
    "slot_mapping": "an int64 tensor [num_tokens] of slots",
    "out": "a tensor [num_query_tokens, num_heads, head_size] to write",
    "query": "a tensor [num_query_tokens, num_heads, head_size]",
    "block_tables": "an int32 tensor [num_seqs, max_blocks_per_seq]",
    "seq_lens": "an int32 tensor [num_seqs], e.g. torch.tensor(lengths, dtype=torch.int32)",
    "cu_seqlens_q": "None or an int32 tensor [num_seqs + 1]",
    "k_amax": "a float32 tensor [1] or [num_kv_heads]",
    "v_amax": "a float32 tensor [1] or [num_kv_heads]",
    "lse": "None or a float32 tensor [num_tokens, num_heads] to write",
    "out_a": "a tensor [num_tokens, num_heads, head_size]",
    "out_b": "a tensor [num_tokens, num_heads, head_size]",
    "lse_a": "a float32 tensor [num_tokens, num_heads]",
    "lse_b": "a float32 tensor [num_tokens, num_heads]",
    "plan": "None or an AttentionPlan (fp8kv.ops.plan_paged_attention)",
}


def _check_arguments(op: str, **arguments) -> None:
    """Raises TypeError naming the first of `arguments` that is not what it must be (a tensor, None
    only for cu_seqlens_q, lse and plan, a KVCacheLayer for layer, an AttentionPlan for plan).
    A type check per argument, no data read: cheap enough for every decode step."""
    for name, value in arguments.items():
        expected = _NOT_TENSORS.get(name, torch.Tensor)
        if not isinstance(value, expected) and not (value is None and name in ("cu_seqlens_q", "lse", "plan")):
            raise TypeError(f"fp8kv.ops.{op}: {name} must be {_TENSORS[name]}, got {type(value).__name__}")


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, layer: KVCacheLayer, slot_mapping: torch.Tensor) -> None:
    """Quantizes `key`/`value` rows with `layer`'s recipe and scales and writes them to their slots of
    `layer`'s caches.

    key, value: [num_tokens, num_kv_heads, head_size], fp16/bf16/fp32, last dim contiguous.
    layer: the KVCacheLayer written. An FP8 cache stores saturate_rne(x / scale) of each row (rotated
        by the block Hadamard matrix, and K minus the layer's K offset, under the rotated recipe:
        docs/rotated_cache.md); an unquantized cache stores the values bit for bit.
    slot_mapping: int64 [n], n <= num_tokens; token i goes to slot block * block_size + offset;
        a negative slot skips the token.
    """
    _check_arguments("reshape_and_cache", key=key, value=value, layer=layer, slot_mapping=slot_mapping)
    torch.ops.fp8kv.reshape_and_cache(key, value, layer.key_cache, layer.value_cache, slot_mapping, layer.k_scale,
                                      layer.v_scale, layer.hadamard, layer.k_offset)


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """How paged_attention runs the calls of one step's sizes: the kernel, the context splits and a
    workspace of their size, made once (plan_paged_attention) and given to every layer's call of the
    step. Made from sizes only, so a CUDA graph replays it; a call checks that it is its own plan.

    values: the plan as the backend made it, [workspace_bytes, forced kernel, kernel, num_splits,
        the backend's other fields] (torch.ops.fp8kv.plan_paged_attention's answer).
    workspace: a uint8 tensor of workspace_bytes on the cache's device, shared by the step's calls
        (they run one after another on one stream; calls on several streams at once need a plan each).
        A CUDA graph that captured calls with the plan writes it at every replay: keep the plan as
        long as the graph.
    """

    values: tuple[int, ...]
    workspace: torch.Tensor

    # Names of the kernels by the plan's third value, per backend: the CUDA backend's are those
    # plan_paged_attention's `kernel` forces ("sm90a" runs `fp8_math` calls in FP8 math).
    KERNELS = {"cpu": ("cpu",), "cuda": ("decode", "sm80", "sm90a", "sm90a"), "hip": ("hip",)}

    @property
    def kernel(self) -> str:
        """The kernel the planned calls run: "cpu"; on CUDA "decode", "sm80" or "sm90a"; "hip" on ROCm."""
        device = self.workspace.device.type
        backend = "hip" if device == "cuda" and torch.version.hip else device
        return self.KERNELS[backend][self.values[2]]

    @property
    def num_splits(self) -> int:
        """Context splits per query row (flash-decoding); 1 writes the output directly."""
        return self.values[3]


# The arguments of the wrappers that are fp8kv objects, not tensors.
_NOT_TENSORS = {"layer": KVCacheLayer, "plan": AttentionPlan}


def plan_paged_attention(
    layer: KVCacheLayer,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    num_query_tokens: int,
    num_heads: int,
    *,
    sliding_window: int = -1,
    fp8_math: bool = False,
    lse: bool = False,
    kernel: str = "auto",
) -> AttentionPlan:
    """The plan of a step's paged_attention calls over caches shaped like `layer`'s: once per step,
    then given to each layer's call (`plan=`), which then allocates nothing and only checks the plan
    against its own sizes.

    From sizes only (no tensor data is read): `layer`'s cache geometry and format, `block_tables`'
    shape, whether `cu_seqlens_q` is given (multi-token queries) or not (decode), the step's query
    rows and heads, and the calls' sliding_window, fp8_math and whether they write `lse`. A call of
    other sizes refuses the plan (RuntimeError) rather than run with it.
    kernel: "auto" (the planner's choice), or on CUDA a kernel forced for multi-token calls: "sm80"
        (every GPU), "sm90a" (compute capability 9.0) or "decode" (short queries; at most
        supported_values("cuda_decode_table_seqs") sequences). Refused where it cannot run the calls.
    Not inside torch.compile'd or traced code: there, paged_attention plans each call itself.
    """
    _check_arguments("plan_paged_attention", layer=layer, block_tables=block_tables, cu_seqlens_q=cu_seqlens_q)
    values = torch.ops.fp8kv.plan_paged_attention(layer.key_cache, block_tables, cu_seqlens_q, num_query_tokens,
                                                  num_heads, sliding_window, fp8_math, lse, kernel)
    workspace = torch.empty(values[0], dtype=torch.uint8, device=layer.key_cache.device)
    return AttentionPlan(tuple(values), workspace)


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    layer: KVCacheLayer,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    softmax_scale: float,
    sliding_window: int = -1,
    logits_soft_cap: float = 0.0,
    fp8_math: bool = False,
    lse: torch.Tensor | None = None,
    plan: AttentionPlan | None = None,
) -> None:
    """Attention of `query` over `layer`'s paged caches (read with the layer's recipe and scales),
    written into `out`.

    query, out: [num_query_tokens, num_heads, head_size], fp16/bf16; num_heads a multiple of the
        cache's num_kv_heads (MHA, GQA, MQA).
    block_tables: int32 [num_seqs, max_blocks_per_seq]; seq_lens: int32 [num_seqs], cached tokens of
        each sequence including the queried ones.
    cu_seqlens_q: None for decode (one query row per sequence), else int32 [num_seqs + 1]: sequence
        i owns rows cu_seqlens_q[i]:cu_seqlens_q[i + 1], its last tokens, attending causally.
    softmax_scale: multiplies q.k (usually head_size ** -0.5).
    sliding_window: -1, or w > 0: a query at position p sees positions > p - w.
    logits_soft_cap: 0, or c > 0: logits become c * tanh(logits / c).
    fp8_math: multi-token queries in FP8 tensor-core math: each query row quantized to e4m3 (its
        largest magnitude to 448), S = Q K^T and O += P V as FP8 MMAs with P quantized to e4m3, O
        accumulated in fp32 every 128 keys. Needs an e4m3fn or e5m2 cache and the CUDA kernels on a
        compute capability 9.0 GPU (head sizes supported_values("cuda_sm90a_fp8_math_head_sizes"));
        refused elsewhere. Calls the decode kernel takes (decode, and short queries: at most 16 query
        rows per sequence and KV head on average) keep 16-bit math: they are bound by memory.
        docs/ops.md gives its accuracy and speed.
    lse: None, or float32 [num_query_tokens, num_heads] (any strides) that receives each row's
        log-sum-exp: the natural log of sum_j exp(logit_j) over the keys the row sees, the logits as
        softmax weighs them (scale, soft cap, recipe included); -inf for a row without keys. With
        the output it is the row's attention state for merge_attention_states.
    plan: None (the call plans itself and allocates its workspace), or the step's AttentionPlan
        (plan_paged_attention), made for this call's sizes.
    A decode row whose sequence has seq_len 0 (batch padding) gets zeros (and lse -inf).
    """
    _check_arguments("paged_attention", out=out, query=query, layer=layer, block_tables=block_tables,
                     seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q, lse=lse, plan=plan)
    torch.ops.fp8kv.paged_attention(
        out, query, layer.key_cache, layer.value_cache, block_tables, seq_lens, cu_seqlens_q, softmax_scale,
        layer.k_scale, layer.v_scale, sliding_window, logits_soft_cap, layer.hadamard, layer.k_offset, fp8_math,
        lse, None if plan is None else plan.values, None if plan is None else plan.workspace,
    )


def merge_attention_states(
    out: torch.Tensor,
    lse: torch.Tensor | None,
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
) -> None:
    """Merges two attention states of the same query rows over disjoint sets of keys (a shared prefix
    and the rest, keys split across devices, a cache and new tokens) into the state over their union.

    out_a, out_b, out: [num_tokens, num_heads, head_size], one dtype of fp16/bf16/fp32, last dim
        contiguous. lse_a, lse_b: float32 [num_tokens, num_heads], natural-log log-sum-exp of each
        row's logits (paged_attention's `lse`); lse: None, or where the merged one goes.
    Per row, in fp32: out = (e^lse_a out_a + e^lse_b out_b) / (e^lse_a + e^lse_b), lse =
    log(e^lse_a + e^lse_b). A side with lse -inf (no keys) does not enter, whatever its output holds;
    with both -inf the row gets zeros and -inf. A NaN log-sum-exp makes the row NaN.
    """
    _check_arguments("merge_attention_states", out=out, lse=lse, out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)
    torch.ops.fp8kv.merge_attention_states(out, lse, out_a, lse_a, out_b, lse_b)


def kv_amax(key: torch.Tensor, value: torch.Tensor, k_amax: torch.Tensor, v_amax: torch.Tensor) -> None:
    """Folds max(|key|) and max(|value|) into the running maxima `k_amax`, `v_amax` in place.

    The granularity follows the maxima's shape: float32 [1] per tensor or [num_kv_heads] per head.
    A NaN in the input makes the maximum NaN.
    """
    _check_arguments("kv_amax", key=key, value=value, k_amax=k_amax, v_amax=v_amax)
    torch.ops.fp8kv.kv_amax(key, value, k_amax, v_amax)


def check_cache_write_indices(slot_mapping: torch.Tensor, layer: KVCacheLayer) -> None:
    """Raises RuntimeError unless every slot is negative (skipped) or inside `layer`'s caches.

    `reshape_and_cache` checks this itself on CPU. On a GPU it does not read the slots (that would
    synchronize): an out-of-range slot there is not written, so its token is lost. Call this where a
    slot mapping is built outside fp8kv's cache modules; it copies the slots to the host (a
    synchronization, so not during CUDA graph capture). FP8KV_DEBUG_CHECKS=1 runs it inside every call.
    """
    _check_arguments("check_cache_write_indices", slot_mapping=slot_mapping, layer=layer)
    torch.ops.fp8kv.check_cache_write_indices(slot_mapping, layer.key_cache)


def check_paged_attention_indices(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    num_query_tokens: int,
    layer: KVCacheLayer,
    sliding_window: int = -1,
) -> None:
    """Raises RuntimeError unless the query rows, lengths and every block id that attention will read
    are consistent with the table and `layer`'s caches (the checks `paged_attention` runs itself on CPU).

    On a GPU, `paged_attention` reads out-of-range block ids as zeros and clamps lengths to the table.
    Copies the tensors to the host (not during CUDA graph capture). FP8KV_DEBUG_CHECKS=1 runs it inside
    every call.
    """
    _check_arguments("check_paged_attention_indices", block_tables=block_tables, seq_lens=seq_lens,
                     cu_seqlens_q=cu_seqlens_q, layer=layer)
    torch.ops.fp8kv.check_paged_attention_indices(block_tables, seq_lens, cu_seqlens_q, num_query_tokens,
                                                  layer.key_cache, sliding_window)
