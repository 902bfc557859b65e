"""Decode attention over a paged FP8 cache against the fastest baselines, all measured in one run.

Shapes are named after the models whose attention layer they are (Llama-3-8B: GQA 32/8, head 128;
Llama-2-7B: MHA 32/32; Llama-3-70B on 8 GPUs: 8/1 per GPU; Llama-3.2-1B: head 64; Gemma-3-12B: 16/8,
head 256; SmolLM2-135M: 9/3, head 64), with a batch and a context length per sequence.

Columns per shape: fp8kv with an e4m3 cache in NHD and HND storage; the same K/V in an e4m3 cache
written with the rotated + centred recipe (docs/rotated_cache.md), read by fp8kv in the same two
storages ("fp8kv e4m3 rotated+centred NHD/HND"); fp8kv with a bf16 cache, bf16
scaled_dot_product_attention on contiguous [B, H, L, D] K/V in every form (flash, efficient, cuDNN
and torch's default dispatch; enable_gqa or K/V expanded to the query heads: the fastest is the
baseline), the naive path (gather the pages, convert to bf16, SDPA), and FlashInfer's FP8 decode
(CUDA-core and tensor-core kernels, NHD and HND: the fastest is the baseline). Every column runs as a
plain launch and replayed from a CUDA graph; its output is checked against float32 attention on the
exact dequantized values first (a rotated column: on the values its cache stands for, in the original
basis).

Effective bandwidth = K+V bytes of the cache a method reads (FP8: 1 byte per element; the bf16
columns: 2) / time. fp8kv is judged on the CUDA-graph time of its faster storage; a baseline's time
is the faster of its launch and graph times. Targets (PASS/MISS):
- shapes with >= 256 MiB of FP8 K/V (head size >= 128): time <= 0.53x the best bf16 SDPA and
  effective bandwidth >= 92% of the read-only bandwidth measured in the same run;
- the smaller shapes (B1 x 32k, B16 x 4k, MQA) and head 64: time <= 0.60x the best bf16 SDPA;
- every shape: time <= FlashInfer's best FP8 decode / 1.1, and relative error <= 1e-2;
- every shape: the rotated + centred recipe's time (CUDA graph, its faster storage) <= 1.03x the
  plain recipe's, and its relative error <= 1e-2.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

import attention_cases as cases
import common
import flashinfer_baseline

# Relative error allowed against float32 attention on the same dequantized values. A correct kernel
# lands near 1e-3: bf16 output rounding alone is ~2^-9 relative per element, and 16-bit P in the PV
# product adds about as much. Wrong scales, heads or pages give errors of order 1e-1 or more.
MAX_REL_ERR = 1e-2
LARGE_KV_BYTES = 256 << 20  # FP8 K+V bytes from which a shape is judged against the read bandwidth
TARGET_SDPA_RATIO_LARGE = 0.53
TARGET_SDPA_RATIO_SMALL = 0.60
TARGET_READ_FRACTION = 0.92
TARGET_FLASHINFER_SPEEDUP = 1.1
TARGET_ROTATED_VS_PLAIN = 1.03

LAYOUTS = ("NHD", "HND")
FP8KV_COLUMNS = ("fp8kv e4m3 NHD", "fp8kv e4m3 HND")
ROTATED_COLUMNS = ("fp8kv e4m3 rotated+centred NHD", "fp8kv e4m3 rotated+centred HND")
FLASHINFER_PREFIX = "FlashInfer "
SDPA_PREFIX = "SDPA "


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    model: cases.Model
    batch: int
    context: int  # cached tokens per sequence, all read by the one query token
    block_size: int = 16
    # fp8kv's columns also get this many more rows of length 0 after the batch's: the padding of a
    # CUDA-graph batch in a server (transformers pads its decode batches to multiples of 64).
    empty_rows: int = 0

    @property
    def label(self) -> str:
        page = "" if self.block_size == 16 else f" bs{self.block_size}"
        padding = f" +{self.empty_rows} empty" if self.empty_rows else ""
        return f"{self.model.name} decode B{self.batch} x {cases.tokens_text(self.context)}{page}{padding}"

    @property
    def is_large(self) -> bool:
        """Judged against the read bandwidth: >= 256 MiB of FP8 K/V in rows of >= 128 bytes."""
        return self.kv_bytes(1) >= LARGE_KV_BYTES and self.model.head_size >= 128

    def kv_bytes(self, element_size: int) -> int:
        """Bytes of K and V for all cached tokens."""
        return 2 * self.batch * self.model.num_kv_heads * self.context * self.model.head_size * element_size


def default_shapes() -> list[DecodeShape]:
    llama3 = [(1, 32768), (1, 131072), (16, 4096), (64, 4096), (16, 16384), (128, 2048), (256, 1024)]
    shapes = [DecodeShape(cases.LLAMA3_8B, b, l, block_size=bs) for bs in (16, 64) for b, l in llama3]
    for model in (cases.LLAMA2_7B, cases.LLAMA3_70B_TP8, cases.LLAMA32_1B, cases.GEMMA3_12B):
        shapes.append(DecodeShape(model, 64, 4096))
    shapes.append(DecodeShape(cases.SMOLLM2_135M, 64, 7680))  # bench_generate.py's SmolLM2 row
    # A server's decode step: transformers' pages of 256 tokens, 65-127 requests padded to 128.
    shapes.append(DecodeShape(cases.LLAMA3_8B, 64, 4096, block_size=256, empty_rows=64))
    return shapes


def quick_shapes() -> list[DecodeShape]:
    return [DecodeShape(cases.LLAMA3_8B, 1, 32768), DecodeShape(cases.LLAMA3_8B, 16, 4096),
            DecodeShape(cases.LLAMA3_8B, 64, 4096), DecodeShape(cases.LLAMA3_70B_TP8, 64, 4096)]


# ----------------------------------------------------------------------------------------------
# Columns: each builder returns a callable that runs the method and returns its [B, Hq, D] output.
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class DecodeCase:
    shape: DecodeShape
    cache: cases.PagedCache
    query: torch.Tensor  # [B, Hq, D] bf16
    softmax_scale: float

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache's K and V in bf16, [B, Hkv, L, D] views of token-major memory."""
        c, context = self.cache, self.shape.context
        return (cases.gather_dequantize(c.key_nhd, c.block_tables, context, c.k_scale),
                cases.gather_dequantize(c.value_nhd, c.block_tables, context, c.v_scale))


def fp8kv_column(ops, case: DecodeCase, key_cache, value_cache, k_scale, v_scale, hadamard=False,
                 k_offset=None) -> Callable[[], torch.Tensor]:
    """fp8kv's decode over the case's rows and its shape's empty rows (block 0, length 0) after them; returns
    the case's rows of the output (the empty rows' are zeros, checked at the first call)."""
    c, empty = case.cache, case.shape.empty_rows
    query = torch.cat([case.query, case.query.new_zeros(empty, *case.query.shape[1:])])
    block_tables = torch.cat([c.block_tables, c.block_tables.new_zeros(empty, c.block_tables.shape[1])])
    seq_lens = torch.cat([c.seq_lens, c.seq_lens.new_zeros(empty)])
    out = torch.full_like(query, float("nan"))
    checked = []

    def run():
        ops.paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, None,
                            case.softmax_scale, k_scale, v_scale, hadamard=hadamard, k_offset=k_offset)
        if not checked:
            if out[case.shape.batch:].count_nonzero():
                raise RuntimeError(f"fp8kv wrote non-zero outputs for the {empty} rows of length 0")
            checked.append(True)
        return out[:case.shape.batch]
    return run


def fp8kv_e4m3_column(ops, case: DecodeCase, cache: cases.PagedCache, layout: str):
    """fp8kv over an e4m3 cache (the case's, or its rotated copy) in one storage, read with its recipe."""
    return fp8kv_column(ops, case, *cache.layout(layout), cache.k_scale, cache.v_scale, cache.hadamard, cache.k_offset)


def fp8kv_bf16_cache_column(ops, case: DecodeCase):
    c = case.cache
    key, value = cases.bf16_paged_cache(c.key_nhd, cases.K_SCALE), cases.bf16_paged_cache(c.value_nhd, cases.V_SCALE)
    ones = torch.ones(1, dtype=torch.float32, device=key.device)  # an unquantized cache takes no scales
    return fp8kv_column(ops, case, key, value, ones, ones)


def sdpa_column(case: DecodeCase, form: cases.SdpaForm):
    """bf16 SDPA over contiguous [B, H, L, D] K/V: what a bf16 cache in that layout costs to read."""
    key, value = (t.contiguous() for t in case.dequantized())
    if form.expanded:
        key, value = (cases.expand_heads(t, case.shape.model.num_heads) for t in (key, value))
    query = case.query.unsqueeze(2)
    return lambda: cases.sdpa(query, key, value, case.softmax_scale, form.backend).squeeze(2)


def dequantize_sdpa_column(case: DecodeCase):
    query = case.query.unsqueeze(2)
    return lambda: cases.sdpa(query, *case.dequantized(), case.softmax_scale, "default").squeeze(2)


def flashinfer_column(flashinfer, case: DecodeCase, layout: str, use_tensor_cores: bool, info: dict):
    c = case.cache
    key, value = c.layout(layout)
    wrapped = flashinfer_baseline.Decode(
        flashinfer, query=case.query, key_cache=key, value_cache=value, kv_layout=layout,
        block_tables=c.block_tables, seq_lens=c.seq_lens, softmax_scale=case.softmax_scale,
        k_scale=cases.K_SCALE, v_scale=cases.V_SCALE, use_tensor_cores=use_tensor_cores)
    info["setup_s"] = wrapped.setup_seconds
    return wrapped


def column_builders(ops, ops_reason: str, flashinfer, shape: DecodeShape,
                    rotated: cases.RotatedCopy) -> dict[str, tuple[int, Callable]]:
    """name -> (bytes per cached element the method reads, builder(case, info) -> run)."""

    def needs_fp8kv(build):
        def checked(case, info):
            if ops is None:
                raise RuntimeError(ops_reason)
            return build(case, info)
        return checked

    builders = {name: (1, needs_fp8kv(lambda case, info, l=layout: fp8kv_e4m3_column(ops, case, case.cache, l)))
                for name, layout in zip(FP8KV_COLUMNS, LAYOUTS)}
    for name, layout in zip(ROTATED_COLUMNS, LAYOUTS):
        builders[name] = (1, needs_fp8kv(lambda case, info, l=layout: fp8kv_e4m3_column(ops, case, rotated.cache, l)))
    builders["fp8kv bf16 cache"] = (2, needs_fp8kv(lambda case, info: fp8kv_bf16_cache_column(ops, case)))
    for form in cases.sdpa_forms(shape.model.num_heads, shape.model.num_kv_heads):
        builders[form.name] = (2, lambda case, info, f=form: sdpa_column(case, f))
    builders["dequant+SDPA"] = (1, lambda case, info: dequantize_sdpa_column(case))
    if flashinfer is not None:
        for cores in ("cuda-core", "tensor-core"):
            for layout in ("NHD", "HND"):
                builders[f"{FLASHINFER_PREFIX}{cores} {layout}"] = (
                    1, lambda case, info, l=layout, tc=cores == "tensor-core": flashinfer_column(flashinfer, case, l, tc, info))
    return builders


# ----------------------------------------------------------------------------------------------
# Measuring one shape, then the derived numbers and targets (the latter are pure Python).
# ----------------------------------------------------------------------------------------------

def make_case(shape: DecodeShape, device: torch.device, seed: int) -> DecodeCase:
    gen = torch.Generator(device).manual_seed(seed)
    m = shape.model
    cache = cases.make_paged_cache(shape.batch, shape.context, m.num_kv_heads, m.head_size, shape.block_size, gen, device)
    query = cases.random_query(shape.batch, m.num_heads, m.head_size, gen, device)
    return DecodeCase(shape, cache, query, m.head_size**-0.5)


def reference_output(case: DecodeCase, rotated: cases.PagedCache | None = None) -> torch.Tensor:
    """float32 attention over the case's cache, or over what its rotated copy stands for."""
    key, value = (case.dequantized() if rotated is None
                  else cases.original_basis(rotated, rotated.block_tables, case.shape.context))
    return cases.reference_attention(case.query.unsqueeze(2), key, value, case.softmax_scale).squeeze(2)


def measure_shape(shape: DecodeShape, setup: common.Setup, seed: int) -> dict:
    case = make_case(shape, setup.device, seed)
    plain_check = common.rel_err_check(reference_output(case))
    rotated = cases.RotatedCopy(setup.ops, case.cache, lambda cache: reference_output(case, cache))
    columns = {}
    builders = column_builders(setup.ops, setup.ops_reason, setup.flashinfer, shape, rotated)
    for name, (element_size, build) in builders.items():
        check = rotated.check if name in ROTATED_COLUMNS else plain_check
        columns[name] = common.measure(lambda info: build(case, info), check, setup.flush)
        columns[name]["bytes"] = shape.kv_bytes(element_size)
        common.add_rate(columns[name], shape.kv_bytes(element_size), "eff_tb_s", common.TB)
    row = {"label": shape.label, "model": shape.model.name, "shape": dataclasses.asdict(shape),
           "fp8_kv_bytes": shape.kv_bytes(1), "large": shape.is_large, "columns": columns}
    row["summary"] = summarize_row(row, setup.ceilings)
    row["targets"] = evaluate_targets(row)
    return row


def summarize_row(row: dict, ceilings: dict) -> dict:
    """fp8kv's faster storage (by graph time), the best baseline of each kind, ratios and fractions."""
    cols = row["columns"]
    best = common.fastest(cols, FP8KV_COLUMNS, common.graph_us) or common.fastest(cols, FP8KV_COLUMNS)
    sdpa = common.fastest(cols, [n for n in cols if n.startswith(SDPA_PREFIX)])
    flashinfer = common.fastest(cols, [n for n in cols if n.startswith(FLASHINFER_PREFIX)])
    summary = {"fp8kv_best": best, "sdpa_best": sdpa, "flashinfer_best": flashinfer,
               "sdpa_us": sdpa and common.best_us(cols[sdpa]),
               "flashinfer_us": flashinfer and common.best_us(cols[flashinfer])}
    summary |= common.rotated_attention_summary(cols, ROTATED_COLUMNS, best and common.graph_us(cols[best]))
    if best is None:
        return summary
    launch_us, us = cols[best]["median_us"], common.graph_us(cols[best])
    summary.update(fp8kv_launch_us=launch_us, fp8kv_graph_us=us, max_fp8kv_rel_err=common.max_rel_err(cols, FP8KV_COLUMNS))
    if us is not None:
        tb_s = row["fp8_kv_bytes"] / (us * 1e-6) / common.TB
        summary.update(fp8kv_tb_s=tb_s, fraction_of_read=tb_s / ceilings["read_tb_s"],
                       fraction_of_copy=tb_s / ceilings["copy_tb_s"])
        if summary["sdpa_us"]:
            summary["vs_sdpa"] = us / summary["sdpa_us"]
        if summary["flashinfer_us"]:
            summary["vs_flashinfer"] = us / summary["flashinfer_us"]
    return summary


def evaluate_targets(row: dict) -> dict[str, bool | None]:
    """Target name -> True (PASS), False (MISS) or None (cannot be judged: a column did not run)."""
    s, judge = row["summary"], common.judge
    ratio, fraction, vs_fi = s.get("vs_sdpa"), s.get("fraction_of_read"), s.get("vs_flashinfer")
    targets: dict[str, bool | None] = {}
    if row["large"]:
        targets[f"<={TARGET_SDPA_RATIO_LARGE}xSDPA"] = judge(lambda: ratio <= TARGET_SDPA_RATIO_LARGE, ratio)
        targets[f">={TARGET_READ_FRACTION:.0%}read"] = judge(lambda: fraction >= TARGET_READ_FRACTION, fraction)
    else:
        targets[f"<={TARGET_SDPA_RATIO_SMALL:.2f}xSDPA"] = judge(lambda: ratio <= TARGET_SDPA_RATIO_SMALL, ratio)
    targets[f"<=FI/{TARGET_FLASHINFER_SPEEDUP}"] = judge(lambda: vs_fi <= 1 / TARGET_FLASHINFER_SPEEDUP, vs_fi)
    return targets | common.attention_error_targets(s, MAX_REL_ERR, TARGET_ROTATED_VS_PLAIN)


def short_form(name: str | None, prefix: str) -> str:
    return name[len(prefix):] if name else "-"


def table(rows: list[dict]) -> str:
    headers = [*common.layout_headers("FP8 MB"), "bf16$ us", "SDPA us", "SDPA form", "FI us", "FI form", "TB/s",
               "%read", "xSDPA", "xFI", "err", f"{common.ROTATED} err", "targets"]
    body = []
    for row in rows:
        cols, s = row["columns"], row["summary"]
        us = lambda name: common.fmt(cols.get(name, {}).get("median_us"))
        body.append([
            *common.layout_cells(row, row["fp8_kv_bytes"], "fp8kv e4m3 NHD", "fp8kv e4m3 HND"), us("fp8kv bf16 cache"),
            common.fmt(s.get("sdpa_us")), short_form(s.get("sdpa_best"), SDPA_PREFIX),
            common.fmt(s.get("flashinfer_us")), short_form(s.get("flashinfer_best"), FLASHINFER_PREFIX),
            common.fmt(s.get("fp8kv_tb_s"), 2),
            common.fmt(100 * s["fraction_of_read"] if "fraction_of_read" in s else None, 0),
            common.fmt(s.get("vs_sdpa"), 2), common.fmt(s.get("vs_flashinfer"), 2),
            common.fmt_err(s.get("max_fp8kv_rel_err")), common.fmt_err(s.get("max_rotated_rel_err")),
            common.targets_text(row.get("targets", {})),
        ])
    return common.format_table(headers, body)


def main() -> None:
    args, shapes, setup = common.start_run(__doc__.split("\n\n")[0], default_shapes(), quick_shapes(), flashinfer=True)
    rows = common.measure_rows(shapes, lambda shape, index: measure_shape(shape, setup, seed=index))
    ceilings = setup.ceilings
    plot = {"metric": "eff_tb_s", "ylabel": "effective bandwidth (TB/s)",
            "lines": {"copy": ceilings["copy_tb_s"], "read": ceilings["read_tb_s"],
                      f"{TARGET_READ_FRACTION:.0%} of read": TARGET_READ_FRACTION * ceilings["read_tb_s"]},
            "series": [common.FP8KV_SERIES, common.ROTATED_SERIES, ["fp8kv bf16 cache", "fp8kv bf16 cache"],
                       common.SDPA_SERIES, ["dequant+SDPA", "dequant+SDPA"], common.FLASHINFER_SERIES],
            "relative_to": ["bf16 SDPA", "@sdpa_best"]}
    common.finish_run("paged_attention_decode", setup, rows, table, plot, args)


if __name__ == "__main__":
    main()
