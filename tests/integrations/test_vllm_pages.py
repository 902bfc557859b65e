"""The vLLM backend's work on vLLM-shaped tensors, without vLLM: fp8kv.integrations.vllm's page_layer,
fp8kv.ops.reshape_and_cache and attend (what the backend's do_kv_cache_update and forward call) on
pages laid out as vLLM's
allocator lays them out, on CPU and, marked gpu, on CUDA.

Pages: per layer, a logical [num_blocks, num_kv_heads, block_size, 2 * head_size] view of one int8
buffer holding two layers, K and V the two halves of the last dimension, in vLLM's NHD (LBNHC) or
HND (LBHNC) memory order, uint8 storage for an FP8 cache; scales as vLLM holds them (0-dim, [1],
[num_kv_heads]); slot mappings padded with -1; vLLM's block sizes. Each step is checked as in
test_vllm.py (vllm_pages.ExpectedPages): exact bytes in both layers' pages, the output against the
float64 reference with the device's bound, zeros for padding requests.

On CUDA a decode step is also captured in a CUDA graph once and replayed for later steps, its
tensors (new K/V and queries, slots, lengths, block tables) updated in place as vLLM updates its
persistent buffers.
"""

from __future__ import annotations

import math

import pytest
import torch
from reference import FORMAT_BY_NAME, assert_within, calibrated_scales, covering_grid, random_kv
from vllm_pages import ExpectedPages, Requests, poison

from fp8kv import ops
from fp8kv.integrations.vllm import AttentionMetadata, attend, page_layer

NUM_BLOCKS, NUM_LAYERS = 40, 2
POOL = 160  # tokens per request at most
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SOFT_CAP = 30.0


def vllm_pages(layout: str, num_blocks: int, num_kv_heads: int, block_size: int, head_size: int,
               storage: torch.dtype, device) -> list[torch.Tensor]:
    """Each layer's page as vLLM's allocator views it, layers outermost in one int8 buffer."""
    element = torch.empty(0, dtype=storage).element_size()
    raw = torch.zeros(NUM_LAYERS * num_blocks * num_kv_heads * block_size * 2 * head_size * element,
                      dtype=torch.int8, device=device).view(storage)
    if layout == "NHD":  # memory [layer, block, slot, head, K|V]
        memory = raw.view(NUM_LAYERS, num_blocks, block_size, num_kv_heads, 2 * head_size)
        return list(memory.transpose(2, 3))
    memory = raw.view(NUM_LAYERS, num_blocks, num_kv_heads, block_size, 2 * head_size)  # HND
    return list(memory)


class Layer:
    """One layer's page (the other layer's next to it) and its scales, with the expected bytes."""

    def __init__(self, case: dict, device: str, seed: int):
        self.case, self.device = case, device
        self.generator = torch.Generator().manual_seed(seed)
        self.dtype = DTYPES[case["dtype"]]
        self.fp8 = None if case["cache_format"] == "none" else FORMAT_BY_NAME[case["cache_format"]].dtype
        self.num_kv_heads, self.head_size = case["num_kv_heads"], case["head_size"]
        self.num_heads = 4 * self.num_kv_heads
        self.window = case["block_size"] + 5 if case.get("window") else -1
        self.soft_cap = SOFT_CAP if case.get("soft_cap") else 0.0
        self.pages = vllm_pages(case["layout"], NUM_BLOCKS, self.num_kv_heads, case["block_size"], self.head_size,
                                torch.uint8 if self.fp8 else self.dtype, device)
        for page in self.pages:
            poison(page, self.fp8)
        self.expected = [ExpectedPages(page, self.fp8, self.dtype) for page in self.pages]
        self.pool = {n: random_kv(3 * POOL, self.num_kv_heads, self.head_size, self.generator).to(self.dtype)
                     for n in "kv"}
        self.k_scale, self.v_scale = (self.scale(self.pool[n]) for n in "kv")
        self.requests = Requests(NUM_BLOCKS, case["block_size"], math.ceil(POOL / case["block_size"]),
                                 self.generator)
        self.pool_offset: dict[str, int] = {}

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        """A scale as vLLM holds it: 0-dim (an FP8 checkpoint's), [1] or [num_kv_heads] (compressed-tensors')."""
        per_head = self.case["scales"] == "per_head"
        scale = calibrated_scales(x.float(), self.case["cache_format"], per_head, self.generator)
        return (scale.reshape(()) if self.case["scales"] == "per_tensor" else scale).to(self.device)

    def inputs(self, step) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's query [num_tokens_padded, H, D] and new K/V (random on padding tokens)."""
        for name, _ in step.rows:
            self.pool_offset.setdefault(name, POOL * len(self.pool_offset))
        index = torch.tensor([self.pool_offset[name] + p for name, p in step.rows], dtype=torch.long)
        padding = torch.randn(step.num_tokens_padded - step.num_tokens, self.num_kv_heads, self.head_size,
                              generator=self.generator).to(self.dtype)
        key, value = (torch.cat([self.pool[n][index], padding]) for n in "kv")
        query = torch.randn(step.num_tokens_padded, self.num_heads, self.head_size, generator=self.generator)
        return query.to(self.dtype), key, value

    def check(self, step, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
              decode: bool) -> None:
        self.expected[0].write(step.slot_mapping[:step.num_tokens], key[:step.num_tokens], value[:step.num_tokens],
                               self.k_scale, self.v_scale)
        for page, expected in zip(self.pages, self.expected):
            expected.assert_held_by(page)
        reference = self.expected[0].reference(query[:step.num_tokens], step, self.k_scale, self.v_scale,
                                               self.head_size**-0.5, self.window, self.soft_cap, self.device)
        assert_within(out[:step.num_tokens], reference, str(step.rows[:3]))
        if decode:
            assert bool((out[step.num_reqs:step.num_reqs_padded] == 0).all()), "padding requests' rows"

    def metadata(self, step, num_decodes: int) -> AttentionMetadata:
        """What the backend's builder makes of the step (decodes first): on the device."""
        query_start_loc = None
        if num_decodes < step.num_reqs_padded:
            query_start_loc = (step.query_start_loc[num_decodes:] - num_decodes).to(self.device)
        return AttentionMetadata(
            num_actual_tokens=step.num_tokens_padded, num_decodes=num_decodes,
            num_query_rows=int(step.query_start_loc[-1]), seq_lens=step.seq_lens.to(self.device),
            block_table=step.block_table.to(self.device), slot_mapping=step.slot_mapping.to(self.device),
            query_start_loc=query_start_loc)

    def run(self, scheduled: list[tuple[str, int]], num_decodes: int, pad_tokens: int = 0, pad_reqs: int = 0):
        step = self.requests.step(scheduled, pad_tokens, pad_reqs)
        metadata = self.metadata(step, num_decodes)
        query, key, value = self.inputs(step)
        out = torch.full_like(query, math.nan, device=self.device)
        layer = page_layer(self.pages[0], self.head_size, self.fp8, self.k_scale, self.v_scale)
        ops.reshape_and_cache(key.to(self.device), value.to(self.device), layer, metadata.slot_mapping)
        attend(out, query.to(self.device), layer, metadata, self.head_size**-0.5, self.window, self.soft_cap)
        self.check(step, query, key, value, out, decode=metadata.query_start_loc is None)


SHORT_NAMES = {"head_size": "h", "block_size": "b", "num_kv_heads": "kv"}


def case_id(case: dict) -> str:
    parts = []
    for name, value in case.items():
        if isinstance(value, bool):
            parts.append(name if value else f"no_{name}")
        else:
            parts.append(f"{SHORT_NAMES.get(name, '')}{value}")
    return "-".join(parts)


# vLLM's block sizes (16 by default; the kernel block sizes the backend declares go to 256) and
# the CUDA kernels' head sizes.
CASES = covering_grid(
    {"cache_format": ["e4m3fn", "e5m2", "e4m3fnuz", "none"], "head_size": [128, 64, 80, 96, 192, 256],
     "layout": ["NHD", "HND"]},
    {"scales": ["per_tensor", "per_tensor_1", "per_head"], "block_size": [16, 32, 64, 128, 256],
     "dtype": list(DTYPES), "num_kv_heads": [2, 1, 8], "window": [False, True], "soft_cap": [False, True]})


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_prefill_chunked_prefill_and_decode_on_vllm_pages(device, case):
    """Two whole prompts and a first chunk; two decodes then the chunk's continuation, with padding
    tokens; a decode batch padded with requests as for a CUDA graph."""
    layer = Layer(case, device, seed=CASES.index(case))
    b = min(case["block_size"], 48)  # prompt lengths span blocks without outgrowing a request's pool
    layer.run([("a", 2 * b + 3), ("b", 5), ("c", 20)], num_decodes=0)
    layer.run([("a", 1), ("b", 1), ("c", b + 7)], num_decodes=2, pad_tokens=3)
    layer.run([("a", 1), ("b", 1), ("c", 1)], num_decodes=5, pad_reqs=2)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_format", ["e4m3fn", "e5m2", "none"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_a_captured_decode_step_replays_with_metadata_updated_in_place(cache_format, layout):
    """A decode batch of 3 requests padded to 4 (vLLM's captured size), captured once; each later step
    copies its queries, K/V, slots, lengths and block tables into the captured tensors and replays.
    The requests cross block boundaries while it runs, so the tables gain entries in place."""
    case = {"cache_format": cache_format, "layout": layout, "scales": "per_tensor", "block_size": 16,
            "head_size": 128, "dtype": "bf16", "num_kv_heads": 2}
    layer = Layer(case, "cuda", seed=7)
    layer.run([("a", 30), ("b", 15), ("c", 1)], num_decodes=0)
    decode = [("a", 1), ("b", 1), ("c", 1)]
    step = layer.requests.step(decode, pad_reqs=1)
    captured = layer.metadata(step, num_decodes=4)
    query, key, value = (t.to("cuda") for t in layer.inputs(step))
    out = torch.zeros_like(query)
    page = layer.pages[0]

    cache_layer = page_layer(page, layer.head_size, layer.fp8, layer.k_scale, layer.v_scale)

    def forward():
        ops.reshape_and_cache(key, value, cache_layer, captured.slot_mapping)
        attend(out, query, cache_layer, captured, layer.head_size**-0.5)

    # Capture on a side stream after a warm-up run there, then restore the cache the warm-up wrote
    # (the first replay writes the same tokens again).
    saved = page.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    page.copy_(saved)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    for i in range(20):
        if i:
            step = layer.requests.step(decode, pad_reqs=1)
            new_query, new_key, new_value = layer.inputs(step)
            for buffer, new in ((query, new_query), (key, new_key), (value, new_value),
                                (captured.slot_mapping, step.slot_mapping), (captured.seq_lens, step.seq_lens),
                                (captured.block_table, step.block_table)):
                buffer.copy_(new)
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        layer.check(step, query.cpu(), key.cpu(), value.cpu(), out, decode=True)
