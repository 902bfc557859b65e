"""Decode attention over a paged FP8 cache (issue 3), every baseline measured in the same run.

Columns per shape: fp8kv with an e4m3 cache in NHD and HND storage, fp8kv with a bf16 cache, bf16
SDPA on contiguous K/V (flash, else efficient: never the math fallback), the naive path (gather the
pages, convert to bf16, SDPA), and FlashInfer's FP8 decode (CUDA-core and tensor-core kernels,
both storages; its best is the comparison). Every column's output is checked once against float32
attention on the exact dequantized values before it is timed.

Effective bandwidth = K+V bytes of the cache a method reads (FP8: 1 byte per element; the bf16
columns: 2) / median time. Targets (issue 3, printed as PASS/MISS, judged on fp8kv's faster e4m3
storage): GQA shapes with >= 64k tokens per batch: <= 0.55x bf16 SDPA time and >= 2.6 TB/s; batch 1:
>= 2.0 TB/s; MHA, MQA and head 64/256: >= 85% of the GQA (64, 4k) bandwidth at the same block size;
every shape: faster than FlashInfer where it runs; every shape: relative error <= 1e-2.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
from typing import Callable

import torch

import attention_cases as cases
import common
import flashinfer_baseline

# Relative error allowed against float32 attention on the same dequantized values. A correct kernel
# lands near 1e-3: bf16 output rounding alone is ~2^-9 relative per element, and 16-bit P in the PV
# product adds about as much. Wrong scales, heads or pages give errors of order 1e-1 or more.
MAX_REL_ERR = 1e-2
TARGET_SDPA_RATIO = 0.55
TARGET_LARGE_BW = 2.6e12
TARGET_BATCH1_BW = 2.0e12
TARGET_VARIANT_FRACTION = 0.85
LARGE_TOKENS = 64 * 1024
GQA = (32, 8, 128)  # query heads, KV heads, head size of the main shape list
GQA_REFERENCE_SHAPE = (64, 4096)  # (batch, context) the MHA/MQA/head-size variants are compared to

FP8KV_COLUMNS = ("fp8kv e4m3 NHD", "fp8kv e4m3 HND")


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    batch: int
    context: int
    num_heads: int = GQA[0]
    num_kv_heads: int = GQA[1]
    head_size: int = GQA[2]
    block_size: int = 16

    @property
    def label(self) -> str:
        return (f"B{self.batch} L{self.context} h{self.num_heads}/{self.num_kv_heads} "
                f"d{self.head_size} bs{self.block_size}")

    @property
    def tokens(self) -> int:
        return self.batch * self.context

    @property
    def is_gqa(self) -> bool:
        return (self.num_heads, self.num_kv_heads, self.head_size) == GQA

    def kv_bytes(self, element_size: int) -> int:
        """Bytes of K and V for all cached tokens."""
        return 2 * self.batch * self.num_kv_heads * self.context * self.head_size * element_size


def issue_shapes() -> list[DecodeShape]:
    gqa = [(1, 32768), (1, 131072), (16, 4096), (64, 4096), (16, 16384), (128, 2048), (256, 1024)]
    shapes = [DecodeShape(b, l, block_size=bs) for bs in (16, 64) for b, l in gqa]
    variants = [dict(num_heads=32, num_kv_heads=32), dict(num_heads=8, num_kv_heads=1),
                dict(head_size=64), dict(head_size=256)]
    shapes += [DecodeShape(*GQA_REFERENCE_SHAPE, block_size=16, **v) for v in variants]
    return shapes


def quick_shapes() -> list[DecodeShape]:
    return [DecodeShape(1, 32768), DecodeShape(16, 4096), DecodeShape(64, 4096),
            DecodeShape(*GQA_REFERENCE_SHAPE, num_heads=8, num_kv_heads=1)]


# ----------------------------------------------------------------------------------------------
# Columns: each builder returns a callable that runs the method and returns its [B, Hq, D] output.
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class DecodeCase:
    shape: DecodeShape
    cache: cases.PagedCache
    query: torch.Tensor  # [B, Hq, D] bf16
    softmax_scale: float


def fp8kv_column(ops, case: DecodeCase, key_cache, value_cache, k_scale, v_scale) -> Callable[[], torch.Tensor]:
    out = torch.full_like(case.query, float("nan"))
    c = case.cache

    def run():
        ops.paged_attention(out, case.query, key_cache, value_cache, c.block_tables, c.seq_lens, None,
                            case.softmax_scale, k_scale, v_scale)
        return out
    return run


def fp8kv_bf16_cache_column(ops, case: DecodeCase):
    c = case.cache
    key, value = cases.bf16_paged_cache(c.key_nhd, cases.K_SCALE), cases.bf16_paged_cache(c.value_nhd, cases.V_SCALE)
    ones = torch.ones(1, dtype=torch.float32, device=key.device)  # an unquantized cache takes no scales
    return fp8kv_column(ops, case, key, value, ones, ones)


def sdpa_column(case: DecodeCase, info: dict):
    c = case.cache
    key = cases.gather_dequantize(c.key_nhd, c.block_tables, c.seq_len, c.k_scale).contiguous()
    value = cases.gather_dequantize(c.value_nhd, c.block_tables, c.seq_len, c.v_scale).contiguous()
    query = case.query.unsqueeze(2)
    info["backend"] = backend = cases.first_working_sdpa_backend(query, key, value, case.softmax_scale)
    return lambda: cases.sdpa(query, key, value, case.softmax_scale, backend).squeeze(2)


def dequantize_sdpa_column(case: DecodeCase, info: dict):
    c = case.cache
    query = case.query.unsqueeze(2)

    def dequantized():
        return (cases.gather_dequantize(c.key_nhd, c.block_tables, c.seq_len, c.k_scale),
                cases.gather_dequantize(c.value_nhd, c.block_tables, c.seq_len, c.v_scale))

    info["backend"] = backend = cases.first_working_sdpa_backend(query, *dequantized(), case.softmax_scale)
    return lambda: cases.sdpa(query, *dequantized(), case.softmax_scale, backend).squeeze(2)


def flashinfer_column(flashinfer, case: DecodeCase, layout: str, use_tensor_cores: bool, info: dict):
    c = case.cache
    key, value = c.layout(layout)
    wrapped = flashinfer_baseline.Decode(
        flashinfer, query=case.query, key_cache=key, value_cache=value, kv_layout=layout,
        block_tables=c.block_tables, seq_lens=c.seq_lens, softmax_scale=case.softmax_scale,
        k_scale=cases.K_SCALE, v_scale=cases.V_SCALE, use_tensor_cores=use_tensor_cores)
    info["setup_s"] = wrapped.setup_seconds
    return wrapped


def column_builders(ops, ops_reason: str, flashinfer) -> dict[str, tuple[int, Callable]]:
    """name -> (bytes per cached element the method reads, builder(case, info) -> run)."""

    def needs_fp8kv(build):
        def checked(case, info):
            if ops is None:
                raise RuntimeError(ops_reason)
            return build(case, info)
        return checked

    builders = {
        "fp8kv e4m3 NHD": (1, needs_fp8kv(lambda case, info: fp8kv_column(
            ops, case, *case.cache.layout("NHD"), case.cache.k_scale, case.cache.v_scale))),
        "fp8kv e4m3 HND": (1, needs_fp8kv(lambda case, info: fp8kv_column(
            ops, case, *case.cache.layout("HND"), case.cache.k_scale, case.cache.v_scale))),
        "fp8kv bf16 cache": (2, needs_fp8kv(lambda case, info: fp8kv_bf16_cache_column(ops, case))),
        "SDPA bf16": (2, sdpa_column),
        "dequant+SDPA": (1, dequantize_sdpa_column),
    }
    if flashinfer is not None:
        for cores in ("cuda-core", "tensor-core"):
            for layout in ("NHD", "HND"):
                builders[f"FlashInfer {cores} {layout}"] = (1, lambda case, info, l=layout, tc=cores == "tensor-core":
                                                            flashinfer_column(flashinfer, case, l, tc, info))
    return builders


# ----------------------------------------------------------------------------------------------
# Measuring one shape, then the derived numbers and targets (the latter are pure Python).
# ----------------------------------------------------------------------------------------------

def make_case(shape: DecodeShape, device: torch.device, seed: int) -> DecodeCase:
    gen = torch.Generator(device).manual_seed(seed)
    cache = cases.make_paged_cache(shape.batch, shape.context, shape.num_kv_heads, shape.head_size,
                                   shape.block_size, gen, device)
    query = cases.random_query(shape.batch, shape.num_heads, shape.head_size, gen, device)
    return DecodeCase(shape, cache, query, shape.head_size**-0.5)


def reference_output(case: DecodeCase) -> torch.Tensor:
    c = case.cache
    key = cases.gather_dequantize(c.key_nhd, c.block_tables, c.seq_len, c.k_scale)
    value = cases.gather_dequantize(c.value_nhd, c.block_tables, c.seq_len, c.v_scale)
    return cases.reference_attention(case.query.unsqueeze(2), key, value, case.softmax_scale).squeeze(2)


def measure_column(build, case: DecodeCase, ref: torch.Tensor, element_size: int, flush) -> dict:
    info = common.measure(lambda info: build(case, info), common.rel_err_check(ref), flush)
    info["bytes"] = case.shape.kv_bytes(element_size)
    if "median_us" in info:
        info["eff_tb_s"] = info["bytes"] / (info["median_us"] * 1e-6) / common.TB
    return info


def measure_shape(shape, builders, device, flush, seed) -> dict:
    case = make_case(shape, device, seed)
    ref = reference_output(case)
    columns = {}
    for name, (element_size, build) in builders.items():
        columns[name] = measure_column(build, case, ref, element_size, flush)
        gc.collect()
        torch.cuda.empty_cache()
    return {"label": shape.label, "shape": dataclasses.asdict(shape), "tokens": shape.tokens,
            "fp8_kv_bytes": shape.kv_bytes(1), "columns": columns}


def fastest(columns: dict, names) -> str | None:
    timed = [n for n in names if n in columns and "median_us" in columns[n]]
    return min(timed, key=lambda n: columns[n]["median_us"]) if timed else None


def summarize_row(row: dict, ceilings: dict) -> dict:
    cols = row["columns"]
    best = fastest(cols, FP8KV_COLUMNS)
    fi_best = fastest(cols, [n for n in cols if n.startswith("FlashInfer")])
    summary = {"fp8kv_best": best, "flashinfer_best": fi_best}
    if best is None:
        return summary
    us = cols[best]["median_us"]
    bw = cols[best]["eff_tb_s"]
    summary.update(
        fp8kv_us=us, fp8kv_tb_s=bw,
        fraction_of_copy=bw / ceilings["copy_tb_s"], fraction_of_read=bw / ceilings["read_tb_s"],
        max_fp8kv_rel_err=max(cols[n].get("rel_err", float("inf")) for n in FP8KV_COLUMNS if n in cols),
    )
    if "median_us" in cols.get("SDPA bf16", {}):
        summary["vs_sdpa"] = us / cols["SDPA bf16"]["median_us"]
    if fi_best is not None:
        summary["vs_flashinfer"] = us / cols[fi_best]["median_us"]
    return summary


def evaluate_targets(rows: list[dict]) -> None:
    """Adds row["targets"]: target name -> True (PASS), False (MISS) or None (cannot be judged)."""
    reference_bw = {}
    for row in rows:
        s = DecodeShape(**row["shape"])
        if s.is_gqa and (s.batch, s.context) == GQA_REFERENCE_SHAPE and "fp8kv_tb_s" in row["summary"]:
            reference_bw[s.block_size] = row["summary"]["fp8kv_tb_s"] * common.TB
    for row in rows:
        s, summary = DecodeShape(**row["shape"]), row["summary"]
        targets: dict[str, bool | None] = {}
        bw = summary.get("fp8kv_tb_s")
        bw = None if bw is None else bw * common.TB
        judge = lambda condition, *values: None if any(v is None for v in values) else condition()
        if s.is_gqa and s.batch == 1:
            targets[">=2.0TB/s"] = judge(lambda: bw >= TARGET_BATCH1_BW, bw)
        elif s.is_gqa and s.tokens >= LARGE_TOKENS:
            ratio = summary.get("vs_sdpa")
            targets["<=0.55xSDPA"] = judge(lambda: ratio <= TARGET_SDPA_RATIO, ratio)
            targets[">=2.6TB/s"] = judge(lambda: bw >= TARGET_LARGE_BW, bw)
        elif not s.is_gqa:
            ref = reference_bw.get(s.block_size)
            targets[">=0.85xGQA"] = judge(lambda: bw >= TARGET_VARIANT_FRACTION * ref, bw, ref)
        vs_fi = summary.get("vs_flashinfer")
        targets["<FlashInfer"] = judge(lambda: vs_fi < 1.0, vs_fi)
        err = summary.get("max_fp8kv_rel_err")
        targets["err<=1e-2"] = judge(lambda: err <= MAX_REL_ERR, err)
        row["targets"] = targets


def table(rows: list[dict]) -> str:
    headers = ["shape", "NHD us", "HND us", "bf16$ us", "SDPA us", "deq+SDPA", "FI us", "TB/s", "%copy",
               "xSDPA", "xFI", "err", "targets"]
    body = []
    for row in rows:
        cols, s = row["columns"], row["summary"]
        us = lambda name: common.fmt(cols.get(name, {}).get("median_us")) if name else "-"
        body.append([
            row["label"], us("fp8kv e4m3 NHD"), us("fp8kv e4m3 HND"), us("fp8kv bf16 cache"), us("SDPA bf16"),
            us("dequant+SDPA"), us(s.get("flashinfer_best")), common.fmt(s.get("fp8kv_tb_s"), 2),
            common.fmt(100 * s["fraction_of_copy"] if "fraction_of_copy" in s else None, 0),
            common.fmt(s.get("vs_sdpa"), 2), common.fmt(s.get("vs_flashinfer"), 2),
            f"{s['max_fp8kv_rel_err']:.1e}" if "max_fp8kv_rel_err" in s else "-",
            " ".join(f"{k}:{common.verdict(v)}" for k, v in row.get("targets", {}).items()),
        ])
    return common.format_table(headers, body)


def errors_text(rows: list[dict]) -> str:
    lines = [f"  {row['label']} / {name}: {col['error']}" for row in rows
             for name, col in row["columns"].items() if "error" in col]
    return "columns that did not run:\n" + "\n".join(lines) if lines else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser)
    parser.add_argument("--no-flashinfer", action="store_true", help="leave FlashInfer's columns out")
    args = parser.parse_args()
    shapes = common.select_shapes(quick_shapes() if args.quick else issue_shapes(), args.shapes)
    device = common.cuda_device_or_exit()
    ops, ops_reason = common.load_fp8kv()
    flashinfer, fi_reason = (None, "disabled by --no-flashinfer") if args.no_flashinfer else flashinfer_baseline.load()
    print(f"fp8kv: {ops_reason}\nFlashInfer: {fi_reason}")
    flush = common.L2Flush(device)
    ceilings = common.measure_ceilings(device, flush).as_dict()
    print(f"device: {torch.cuda.get_device_name(device)}; copy {ceilings['copy_tb_s']:.2f} TB/s (read + write), "
          f"read-only sum {ceilings['read_tb_s']:.2f} TB/s")

    builders = column_builders(ops, ops_reason, flashinfer)
    rows = []
    for index, shape in enumerate(shapes):
        row = measure_shape(shape, builders, device, flush, seed=index)
        row["summary"] = summarize_row(row, ceilings)
        rows.append(row)
        print(f"[{index + 1}/{len(shapes)}] {shape.label}: fp8kv {common.fmt(row['summary'].get('fp8kv_us'))} us",
              flush=True)
    evaluate_targets(rows)
    print(table(rows))
    print(errors_text(rows))
    payload = common.run_header("paged_attention_decode", device) | {
        "ceilings": ceilings, "fp8kv": ops_reason, "flashinfer": fi_reason, "rows": rows,
        "plot": {"metric": "eff_tb_s", "ylabel": "effective bandwidth (TB/s)",
                 "lines": {"copy": ceilings["copy_tb_s"], "read": ceilings["read_tb_s"],
                           "target 2.6": TARGET_LARGE_BW / common.TB},
                 "series": [["fp8kv e4m3 (faster storage)", "@fp8kv_best"], ["fp8kv bf16 cache", "fp8kv bf16 cache"],
                            ["SDPA bf16", "SDPA bf16"], ["dequant+SDPA", "dequant+SDPA"],
                            ["FlashInfer FP8 (best)", "@flashinfer_best"]],
                 "relative_to": "SDPA bf16"},
    }
    common.write_outputs(payload, args)


if __name__ == "__main__":
    main()
