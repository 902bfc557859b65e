"""The vLLM classes of fp8kv's attention backend, which fp8kv.integrations.vllm registers as FP8KV.

Modelled on vLLM's FlashAttention backend: vLLM writes each step's K/V through the layer's
`do_kv_cache_update` (fp8kv's reshape_and_cache), then calls `forward` (fp8kv's paged_attention),
both on the layer's page of vLLM's cache in place, as one KVCacheLayer with the layer's recipe and
scales (fp8kv.integrations.vllm says how the page is viewed).
Needs vLLM (pyproject.toml's [vllm] extra); docs/vllm.md says what the backend refuses.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import vllm
from packaging.version import Version
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.models.utils import extract_layer_index
from vllm.platforms import current_platform
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl, AttentionMetadataBuilder,
                                       AttentionType, CommonAttentionMetadata)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from .. import ops
from .._ops import has_cuda_kernels, supported_values
from ..formats import KVCacheConfig
from ..layer import KVCacheLayer
from ..rotation import Rotation
from .vllm import (BACKEND_NAME, KV_CACHE_DTYPES, SUPPORTED_VLLM, AttentionMetadata, attend, cache_format,
                   kv_cache_halves, page_layer)
from .vllm_recipe import ROTATION_KEY, chosen_rotation, rotated_recipe


def runs_on(capability: DeviceCapability | None) -> bool:
    """The NVIDIA GPUs the CUDA kernels are built for by default (TORCH_CUDA_ARCH_LIST 8.0;8.9;9.0a):
    sm_80 code runs on every 8.x device, the sm_90a code on 9.0 (H100, H200); there is none for 10.0
    and later. vLLM reports AMD's MI300 as 9.4: not one of these. A platform without a compute
    capability (None) is one only where it is vLLM's CPU platform: fp8kv's CPU kernels."""
    if capability is None:
        return current_platform.is_cpu()
    return capability.major == 8 or capability == DeviceCapability(9, 0)


def checkpoint_recipe(config: VllmConfig, fp8: torch.dtype | None) -> KVCacheConfig:
    """This tensor-parallel rank's rotated recipe for the model vLLM serves (vllm_recipe.rotated_recipe)."""
    return rotated_recipe(config.model_config.model, fp8, get_tensor_model_parallel_rank(),
                          get_tensor_model_parallel_world_size())


class Fp8kvAttentionBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    # fp8 and fp8_e4m3 are the platform's e4m3 format; vLLM's FlashAttention backend has no fp8_e5m2.
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(KV_CACHE_DTYPES)
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[Fp8kvAttentionImpl]:
        return Fp8kvAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[Fp8kvMetadataBuilder]:
        return Fp8kvMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(supported_values("cuda_head_sizes"))

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return list(supported_values("cuda_block_sizes"))

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_per_head_quant_scales(cls) -> bool:
        return True

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return runs_on(capability)

    @classmethod
    def validate_configuration(cls, *args, **kwargs) -> list[str]:
        """vLLM's checks of the supports_* answers above (MLA, sinks, sparse, non-causal attention and
        the rest are refused there), then the vLLM version and, on CUDA, fp8kv's CUDA kernels."""
        reasons = super().validate_configuration(*args, **kwargs)
        if Version(vllm.__version__).release[:2] != SUPPORTED_VLLM:
            reasons.append(f"fp8kv's backend is written for vLLM {'.'.join(map(str, SUPPORTED_VLLM))}, "
                           f"not {vllm.__version__}")
        if current_platform.is_cuda() and not has_cuda_kernels():
            reasons.append("fp8kv was built without its CUDA kernels")
        return reasons


class Fp8kvMetadataBuilder(AttentionMetadataBuilder[AttentionMetadata]):
    # fp8kv's kernels plan each launch from the call's sizes, never from device data, and the decode
    # call reads vLLM's persistent seq_lens and block-table buffers: a captured decode step replays
    # with the values vLLM writes there. A mixed batch's graph would fix its decode/prefill split,
    # so only uniform single-token decode batches are declared.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    supports_update_block_table: bool = True

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)  # vLLM puts the one-token (decode) requests first

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> AttentionMetadata:
        m = common_attn_metadata
        num_decodes, _, _, _ = split_decodes_and_prefills(m, decode_threshold=self.reorder_batch_threshold)
        query_start_loc = None
        if num_decodes < m.num_reqs:
            # The other requests' rows start after the decodes' one row each.
            query_start_loc = m.query_start_loc[num_decodes:] - num_decodes
        return AttentionMetadata(
            num_actual_tokens=m.num_actual_tokens, num_decodes=num_decodes,
            num_query_rows=int(m.query_start_loc_cpu[m.num_reqs]), seq_lens=m.seq_lens,
            block_table=m.block_table_tensor, slot_mapping=m.slot_mapping, query_start_loc=query_start_loc)

    def update_block_table(self, metadata: AttentionMetadata, blk_table: torch.Tensor,
                           slot_mapping: torch.Tensor) -> AttentionMetadata:
        return dataclasses.replace(metadata, block_table=blk_table, slot_mapping=slot_mapping)


class Fp8kvAttentionImpl(AttentionImpl[AttentionMetadata]):
    # The query stays in the model's dtype: fp8kv's kernels do not take an FP8 query.
    supports_quant_query_input: bool = False

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks: torch.Tensor | None = None) -> None:
        refused = {"ALiBi (alibi_slopes)": alibi_slopes is not None, "attention sinks (sinks)": sinks is not None,
                   f"attn_type {attn_type!r} (decoder attention only)": attn_type != AttentionType.DECODER}
        for what, present in refused.items():
            if present:
                raise NotImplementedError(f"fp8kv's attention backend does not support {what}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.sliding_window = -1 if sliding_window is None else sliding_window
        self.logits_soft_cap = logits_soft_cap or 0.0
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8 = cache_format(kv_cache_dtype, current_platform.fp8_dtype())
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        # The rotated recipe (vllm_recipe says how it is chosen): the model's recipe is read here, at
        # model construction, and bound to this layer once the weights are loaded
        # (process_weights_after_loading), when the layer's name and device are known.
        config = get_current_vllm_config()
        self.rotated: KVCacheConfig | None = None
        self.rotated_layer: KVCacheLayer | None = None  # the layer's recipe, over empty caches until a call
        if chosen_rotation(config.additional_config, self.fp8) is Rotation.HADAMARD:
            refused = {"speculative decoding (a draft model's layers are not the checkpoint's)":
                       config.speculative_config is not None,
                       "a layer reading another layer's cache (kv_sharing_target_layer_name)":
                       kv_sharing_target_layer_name is not None}
            for what, present in refused.items():
                if present:
                    raise NotImplementedError(f"fp8kv's rotated recipe ({ROTATION_KEY} 'hadamard', the default for "
                                              f"an FP8 cache) does not support {what}; choose the plain recipe "
                                              f"({ROTATION_KEY} 'none')")
            self.rotated = checkpoint_recipe(config, self.fp8)

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        if self.rotated is None:
            return
        context = get_current_vllm_config().compilation_config.static_forward_context
        name = next(name for name, layer in context.items() if getattr(layer, "impl", None) is self)
        index, device = extract_layer_index(name), context[name]._k_scale.device
        if not 0 <= index < self.rotated.num_layers:
            raise ValueError(f"fp8kv's rotated recipe: layer {name!r} (index {index}) is not one of the checkpoint's "
                             f"{self.rotated.num_layers} layers ({self.rotated.source})")
        empty = torch.empty((0, 1, self.num_kv_heads, self.head_size), dtype=self.fp8, device=device)
        self.rotated_layer = KVCacheLayer._of_config(self.rotated, index, empty, empty)

    def _layer(self, layer: torch.nn.Module, kv_cache: torch.Tensor) -> KVCacheLayer:
        """The KVCacheLayer of this layer's page: the plain recipe with the scales vLLM holds, or the
        rotated one bound for this layer."""
        if self.rotated is None:
            return page_layer(kv_cache, self.head_size, self.fp8, layer._k_scale, layer._v_scale)
        if self.rotated_layer is None:
            raise RuntimeError("fp8kv's rotated recipe is bound to a layer when vLLM has loaded the model's weights "
                               "(process_weights_after_loading), which has not happened for this layer")
        return self.rotated_layer.with_caches(*kv_cache_halves(kv_cache, self.head_size, self.fp8))

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        ops.reshape_and_cache(key, value, self._layer(layer, kv_cache), slot_mapping)

    def forward(self, layer: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fp8kv's attention backend does not quantize its output (output_scale)")
        if attn_metadata is None:  # vLLM's profiling run, before there is a cache
            return output.fill_(0)
        attend(output, query, self._layer(layer, kv_cache), attn_metadata, self.scale, self.sliding_window,
               self.logits_soft_cap)
        return output
