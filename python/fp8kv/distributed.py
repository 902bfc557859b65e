"""Tensor-parallel reduction of calibration maxima, and the one-writer rule for exports.

Under tensor parallelism each rank observes the K/V of its own KV heads: rank r holds heads
[r * h, (r + 1) * h) of the model's num_kv_heads (h = num_kv_heads / tp_size), or, with fewer KV
heads than ranks, the single head r // (tp_size / num_kv_heads). This is the split
`checkpoint.shard_kv_heads` undoes at load time. Per-tensor maxima are all-reduced with MAX;
per-head maxima are gathered back into global head order. All of it is exact (a maximum is
one of its inputs), so TP=N calibration gives the TP=1 scales bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_writer(group=None) -> bool:
    """True on the one rank that writes files: rank 0 of `group`, or the only process."""
    return not is_distributed() or dist.get_rank(group) == 0


def on_writer(write, group=None) -> None:
    """Calls `write()` on the writer rank only; every rank returns once it is done, or raises if it failed."""
    if not is_distributed():
        write()
        return
    failure = [None]
    if is_writer(group):
        try:
            write()
        except Exception as e:
            failure = [f"{type(e).__name__}: {e}"]
            raise
        finally:
            dist.broadcast_object_list(failure, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    else:
        dist.broadcast_object_list(failure, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        if failure[0] is not None:
            raise RuntimeError(f"rank 0 failed to write: {failure[0]}")


def reduce_amax(local: torch.Tensor, granularity: str, num_kv_heads: int, group=None) -> torch.Tensor:
    """The global maxima from every rank's `local` maxima [..., width]; returns a CPU tensor.

    granularity 'tensor': width 1 on every rank, all-reduced with MAX.
    granularity 'head': width = the rank's KV heads. Every rank holding all num_kv_heads heads
    (the model is replicated, e.g. data-parallel calibration) is a MAX all-reduce too; otherwise
    the ranks' heads are gathered into global head order (the result's width is num_kv_heads).
    A NaN anywhere makes the corresponding result NaN, whatever the backend's MAX does with NaN.
    """
    x = local.to(_collective_device(group))
    width = _common_width(x, group)
    if granularity == "tensor":
        return _all_reduce_max(x, group).cpu()
    layout = _head_layout(width, num_kv_heads, group)
    if layout == "all":
        return _all_reduce_max(x, group).cpu()
    gathered = torch.cat(_all_gather(x, group), dim=-1)
    if layout == "split":
        return gathered.cpu()
    # Head g is replicated on the world / num_kv_heads consecutive ranks starting at g * (world / num_kv_heads).
    return gathered.unflatten(-1, (num_kv_heads, -1)).amax(dim=-1).cpu()


def reduce_head_sums(local: torch.Tensor, num_tokens: int, num_kv_heads: int, group=None) -> tuple[torch.Tensor, int]:
    """Per-head sums over every rank's tokens, from every rank's `local` sums [..., width] over its
    `num_tokens` tokens; returns (a CPU tensor with width num_kv_heads, the tokens summed).

    Every rank holding all heads (data parallel: each saw its own tokens) is a SUM all-reduce, and
    the token counts add up. Otherwise every rank saw every token (tensor parallel): the ranks'
    heads are gathered into global head order, and of a replicated head the first copy is taken
    (its copies are sums over the same tokens).
    """
    x = local.to(_collective_device(group))
    layout = _head_layout(_common_width(x, group), num_kv_heads, group)
    if layout == "all":
        count = torch.tensor([num_tokens], dtype=torch.int64, device=x.device)
        dist.all_reduce(x, group=group)
        dist.all_reduce(count, group=group)
        return x.cpu(), int(count.item())
    gathered = torch.cat(_all_gather(x, group), dim=-1)
    if layout == "split":
        return gathered.cpu(), num_tokens
    return gathered.unflatten(-1, (num_kv_heads, -1))[..., 0].cpu(), num_tokens


def _head_layout(width: int, num_kv_heads: int, group) -> str:
    """How the ranks hold the KV heads, each `width` of them: 'all' (every rank all heads), 'split'
    (num_kv_heads / world_size each) or 'replicated' (one head each, on world / num_kv_heads ranks)."""
    world = dist.get_world_size(group)
    if width == num_kv_heads:
        return "all"
    if width * world == num_kv_heads:
        return "split"
    if width == 1 and world % num_kv_heads == 0:
        return "replicated"
    raise ValueError(
        f"each of the {world} ranks observed {width} KV heads, which does not split num_kv_heads={num_kv_heads} "
        "across ranks (expected num_kv_heads / world_size heads per rank, one replicated head per rank, or all heads)"
    )


def _collective_device(group) -> torch.device:
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _common_width(x: torch.Tensor, group) -> int:
    """The width all ranks share; a rank whose shape differs is an error on every rank (no hang)."""
    shape = torch.tensor(list(x.shape), dtype=torch.int64, device=x.device)
    extremes = torch.cat([shape, -shape])
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    largest, smallest = extremes[: x.dim()].tolist(), [-s for s in extremes[x.dim():].tolist()]
    if largest != smallest:
        raise ValueError(f"ranks observed different amax shapes: between {smallest} and {largest}")
    return x.shape[-1]


def _all_reduce_max(x: torch.Tensor, group) -> torch.Tensor:
    # MAX of (x with NaN as +inf, NaN flag): backends' MAX need not propagate NaN, +inf always wins.
    is_nan = x.isnan()
    packed = torch.stack([torch.where(is_nan, torch.inf, x), is_nan.to(x.dtype)])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    return torch.where(packed[1] > 0, torch.nan, packed[0])


def _all_gather(x: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts
