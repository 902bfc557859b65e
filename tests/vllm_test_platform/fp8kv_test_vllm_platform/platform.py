"""vLLM's own CPU platform with two changes, so that vLLM's PyPI wheel (a CUDA build) runs whole
engines on a machine without a GPU, on fp8kv's CPU kernels:

- `get_attn_backend_cls` gives the attention backend the engine selects (`attention_backend`,
  `--attention-backend`), checked by the backend's `validate_configuration` as vLLM's CUDA platform
  checks it; vLLM's CPU platform always gives its own, which needs vLLM's CPU build.
- The engine's executor as vLLM runs it on a GPU: the worker in the engine core's process (`uni`)
  for one rank, where vLLM's CPU platform starts a process for it too (`mp`), to bind its OpenMP
  threads; a test then starts one process less.
- Pure-torch stand-ins for the operators of vLLM's CPU build that its CPU worker, sampler and slot
  mapping call (`torch.ops._C.*`), which the CUDA wheel does not have.
"""

from __future__ import annotations

import torch
from vllm.platforms.cpu import CpuPlatform
from vllm.v1.attention.backends.registry import AttentionBackendEnum

_library = torch.library.Library("_C", "FRAGMENT")  # vLLM's CPU build's namespace
_library.define("init_cpu_memory_env(int[] memory_nodes) -> ()")
_library.define("greedy_argmax(Tensor logits) -> Tensor")
_library.define("compute_slot_mapping_kernel_impl(Tensor query_start_loc, Tensor positions, Tensor block_table, "
                "Tensor(a!) slot_mapping, int block_size) -> ()")


@torch.library.impl(_library, "init_cpu_memory_env", "CompositeExplicitAutograd")
def init_cpu_memory_env(memory_nodes: list[int]) -> None:
    """vLLM's CPU build binds memory to NUMA nodes here; without it, memory is where the OS puts it."""


@torch.library.impl(_library, "greedy_argmax", "CompositeExplicitAutograd")
def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """What vLLM's sampler does on other platforms: the first maximum of each row."""
    return logits.argmax(dim=-1).view(-1)


@torch.library.impl(_library, "compute_slot_mapping_kernel_impl", "CompositeExplicitAutograd")
def compute_slot_mapping(query_start_loc: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
                         slot_mapping: torch.Tensor, block_size: int) -> None:
    """Token t of request r at position p goes to slot block_table[r, p // block_size] * block_size
    + p % block_size; slots past the step's tokens are left as they are (as vLLM's CPU build does)."""
    starts = query_start_loc.long()
    num_tokens = int(starts[-1])
    requests = torch.repeat_interleave(torch.arange(len(starts) - 1), starts.diff())
    p = positions[:num_tokens]
    blocks = block_table[requests, p // block_size].long()
    slot_mapping[:num_tokens] = blocks * block_size + p % block_size


class TestCpuPlatform(CpuPlatform):
    @classmethod
    def get_attn_backend_cls(cls, selected_backend: AttentionBackendEnum | None, attn_selector_config,
                             num_heads: int | None = None) -> str:
        if selected_backend is None or selected_backend == AttentionBackendEnum.CPU_ATTN:
            return super().get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)
        reasons = selected_backend.get_class().validate_configuration(
            device_capability=cls.get_device_capability(), **attn_selector_config._asdict())
        if reasons:
            raise ValueError(f"Selected backend {selected_backend} is not valid for this configuration. "
                             f"Reason: {reasons}")
        return selected_backend.get_path()

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        executor = vllm_config.parallel_config.distributed_executor_backend
        super().check_and_update_config(vllm_config)
        vllm_config.parallel_config.distributed_executor_backend = executor
