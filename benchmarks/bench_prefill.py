"""Multi-token attention over a paged FP8 cache (fp8kv's cu_seqlens_q path): prefill, chunked
prefill, speculative verification and a mixed batch, every baseline measured in the same run.

Shapes (Llama-3-8B: GQA 32/8, head 128; block 16): prefill of 4096 tokens (B4); chunked prefill of
512 new tokens over 8192 cached (B8); verification of 2, 4 and 8 draft tokens over 4096 cached (B64);
a mixed batch in one call: 64 sequences decoding one token over 4096 cached and 2 prefilling 2048 tokens;
and prefill of 4096 tokens (B4) at head sizes 64 (Llama-3.2-1B: GQA 32/8) and 256 (Gemma-3-12B: GQA 16/8).
Columns: fp8kv e4m3 in NHD and HND storage; the same K/V in an e4m3 cache written with the rotated +
centred recipe (docs/rotated_cache.md), read by fp8kv in the same two storages ("fp8kv e4m3
rotated+centred NHD/HND"); each of these again in FP8 math (`fp8_math=True`: "... fp8-math ...");
bf16 scaled_dot_product_attention (causal, aligned to
the end of the keys) on contiguous K/V in every form (flash, efficient, cuDNN, torch's default;
enable_gqa or expanded K/V), one call per group of equal sequences; FlashInfer's FP8 paged prefill
in both storages, FA2 (bf16 query) and FA3 (FP8 math: the query quantized to e4m3 per head inside
the timed call); for verification, fp8kv's decode (one query token) over the same cache.
Every column runs as a plain launch and replayed from a CUDA graph; its output is checked against
float32 attention on the exact dequantized values first (a rotated column: on the values its cache
stands for, in the original basis).

Throughput = causally visible multiply-adds x 2 (QK^T and PV) / time, the same count for every
column. fp8kv is judged on the CUDA-graph time of its faster storage; a baseline's time is the
faster of its launch and graph times. Targets (PASS/MISS): every shape: throughput >= 1.0x bf16
SDPA flash (its faster form), >= 1.0x the fastest bf16 SDPA form of the run (cuDNN where it runs),
and FlashInfer's FP8 prefill time >= 1.3x fp8kv's; verification: time <= 1.1x fp8kv's decode on the
same cache; relative error <= 1e-2; every shape: the rotated + centred recipe's time (CUDA graph,
its faster storage) <= 1.05x the plain recipe's, and its relative error <= 1e-2. FP8 math: Llama-3-8B
prefill and chunked prefill >= 1.5x the fastest bf16 SDPA form, the other head sizes' prefill >= 1.3x,
every shape >= 1.0x FlashInfer's FA3 FP8 prefill where it runs, relative error <= MAX_FP8_MATH_REL_ERR,
rotated + centred <= 1.05x plain in FP8 math too.
"""

from __future__ import annotations

import dataclasses

import torch

import attention_cases as cases
import common
import flashinfer_baseline

MAX_REL_ERR = 1e-2  # as in bench_paged_attention.py: bf16 output rounding and 16-bit P give ~1e-3
# FP8 math (e4m3 query, e4m3 P): each rounding to 3 mantissa bits adds ~2.5e-2 on this data (random
# V, so the output averages noise and keeps each rounding's relative error); an emulation of both on
# these shapes lands at 3.0-3.7e-2 (head sizes 64-256, 4 to 2048 queries over up to 8k keys).
MAX_FP8_MATH_REL_ERR = 5e-2
TARGET_SDPA_FLASH_THROUGHPUT = 1.0
TARGET_SDPA_THROUGHPUT = 1.0  # against the fastest SDPA form of the run
TARGET_FLASHINFER_SLOWER = 1.3
TARGET_VERIFY_VS_DECODE = 1.1
TARGET_ROTATED_VS_PLAIN = 1.05
# FP8 math: against the fastest bf16 SDPA form, Llama-3-8B's prefill and chunked prefill / other
# head sizes' prefill; against FlashInfer's FA3 FP8 prefill on every shape.
TARGET_FP8_MATH_SDPA = 1.5
TARGET_FP8_MATH_SDPA_OTHER_HEADS = 1.3
TARGET_FP8_MATH_FLASHINFER = 1.0
# The query and P rounded to e4m3 (2^-4 relative at most, about 2.5% RMS per element) put the output
# 3.0e-2 to 3.7e-2 of its norm off on these random caches (NVIDIA H200); tests/ops/test_fp8_math.py
# bounds it element by element. A wrong kernel lands far above.
MAX_FP8_MATH_REL_ERR = 5e-2
LAYOUTS = ("NHD", "HND")
FP8KV_COLUMNS = ("fp8kv e4m3 NHD", "fp8kv e4m3 HND")
ROTATED_COLUMNS = ("fp8kv e4m3 rotated+centred NHD", "fp8kv e4m3 rotated+centred HND")
FP8_MATH_COLUMNS = ("fp8kv e4m3 fp8-math NHD", "fp8kv e4m3 fp8-math HND")
ROTATED_FP8_MATH_COLUMNS = ("fp8kv e4m3 rotated+centred fp8-math NHD", "fp8kv e4m3 rotated+centred fp8-math HND")
DECODE_COLUMNS = ("fp8kv decode NHD", "fp8kv decode HND")
FLASHINFER_PREFIX = "FlashInfer "
FLASHINFER_FP8_MATH = "FA3 FP8 "  # "FlashInfer FA3 FP8 NHD" / "... HND"
SDPA_PREFIX = "SDPA "
SDPA_FLASH_PREFIX = "SDPA flash"  # "SDPA flash" and "SDPA flash expanded"
FLASHINFER_FA3_PREFIX = "FlashInfer FA3 "  # its FP8-query prefill: the FP8 math's peer


@dataclasses.dataclass(frozen=True)
class Sequences:
    """`batch` sequences, each with `q_len` new query tokens over `cached` tokens already in the cache."""

    batch: int
    q_len: int
    cached: int

    @property
    def seq_len(self) -> int:
        return self.cached + self.q_len

    @property
    def label(self) -> str:
        return f"B{self.batch} x {cases.tokens_text(self.q_len)}" + (f" over {cases.tokens_text(self.cached)}" if self.cached else "")


@dataclasses.dataclass(frozen=True)
class PrefillShape:
    kind: str  # "prefill", "chunked prefill", "verify" or "mixed"
    groups: tuple[Sequences, ...]  # a batch of one or more groups of equal sequences, in this order
    model: cases.Model = cases.LLAMA3_8B
    block_size: int = 16

    @property
    def label(self) -> str:
        return f"{self.model.name} {self.kind} " + " + ".join(g.label for g in self.groups)

    @property
    def flops(self) -> int:
        m = self.model
        return sum(cases.attention_flops(g.batch, g.q_len, g.seq_len, m.num_heads, m.head_size) for g in self.groups)


def default_shapes() -> list[PrefillShape]:
    return [PrefillShape("prefill", (Sequences(4, 4096, 0),)),
            PrefillShape("chunked prefill", (Sequences(8, 512, 8192),)),
            *(PrefillShape("verify", (Sequences(64, draft, 4096),)) for draft in (2, 4, 8)),
            PrefillShape("mixed", (Sequences(64, 1, 4096), Sequences(2, 2048, 0))),
            # Head sizes 64 and 256: prefill B4 x 4k on a model of each.
            PrefillShape("prefill", (Sequences(4, 4096, 0),), model=cases.LLAMA32_1B),
            PrefillShape("prefill", (Sequences(4, 4096, 0),), model=cases.GEMMA3_12B)]


@dataclasses.dataclass
class GroupCase:
    """One group's query rows and its K/V dequantized to bf16 ([B, Hkv, L, D], contiguous)."""

    sequences: Sequences
    query: torch.Tensor  # [B * q_len, Hq, D] bf16
    key: torch.Tensor
    value: torch.Tensor

    def batched(self, rows: torch.Tensor) -> torch.Tensor:
        """[B * q_len, H, D] rows as the [B, H, q_len, D] view SDPA and the reference take."""
        g = self.sequences
        return rows.view(g.batch, g.q_len, rows.shape[1], rows.shape[2]).transpose(1, 2)


@dataclasses.dataclass
class PrefillCase:
    shape: PrefillShape
    groups: list[GroupCase]
    cache: cases.PagedCache  # every sequence of every group
    query: torch.Tensor  # every group's rows, in order
    cu_seqlens_q: torch.Tensor  # int32 [num_seqs + 1]
    softmax_scale: float

    def reference_rows(self, rotated: cases.PagedCache | None = None) -> torch.Tensor:
        """float32 attention of every query row, [total rows, Hq, D]: over the case's cache, or over
        what its rotated copy stands for."""
        kv = ((g.key, g.value) for g in self.groups) if rotated is None else self.original_basis(rotated)
        refs = [cases.reference_attention(g.batched(g.query), key, value, self.softmax_scale)
                for g, (key, value) in zip(self.groups, kv)]
        return torch.cat([rows_of(ref) for ref in refs])

    def original_basis(self, rotated: cases.PagedCache):
        """Each group's K/V that the rotated copy stands for, one group at a time."""
        tables = rotated.block_tables.split([g.sequences.batch for g in self.groups])
        return (cases.original_basis(rotated, t, g.sequences.seq_len) for g, t in zip(self.groups, tables))

    def last_rows(self) -> torch.Tensor:
        """Each sequence's last query row, [B, Hq, D]: the decode step of the same cache (one group)."""
        (group,) = self.groups
        return group.batched(group.query)[:, :, -1].contiguous()


def rows_of(batched: torch.Tensor) -> torch.Tensor:
    """[B, H, q_len, D] attention output as [B * q_len, H, D] rows."""
    return batched.transpose(1, 2).reshape(-1, batched.shape[1], batched.shape[3])


def make_case(shape: PrefillShape, device: torch.device, seed: int) -> PrefillCase:
    gen = torch.Generator(device).manual_seed(seed)
    m = shape.model
    caches, groups = [], []
    for g in shape.groups:
        cache = cases.make_paged_cache(g.batch, g.seq_len, m.num_kv_heads, m.head_size, shape.block_size, gen, device)
        key, value = (cases.gather_dequantize(codes, cache.block_tables, g.seq_len, scale).contiguous()
                      for codes, scale in ((cache.key_nhd, cache.k_scale), (cache.value_nhd, cache.v_scale)))
        query = cases.random_query(g.batch * g.q_len, m.num_heads, m.head_size, gen, device)
        caches.append(cache)
        groups.append(GroupCase(g, query, key, value))
    q_lens = torch.tensor([g.q_len for g in shape.groups for _ in range(g.batch)], device=device)
    cu_seqlens_q = torch.nn.functional.pad(torch.cumsum(q_lens, 0), (1, 0)).to(torch.int32)
    cache = caches[0] if len(caches) == 1 else cases.concatenate_caches(caches)
    query = torch.cat([g.query for g in groups])
    return PrefillCase(shape, groups, cache, query, cu_seqlens_q, m.head_size**-0.5)


def fp8kv_column(ops, case: PrefillCase, cache: cases.PagedCache, layout: str, decode: bool = False,
                 fp8_math: bool = False, kernel: str = "auto"):
    """fp8kv over an e4m3 cache (the case's, or its rotated copy) in one storage, read with its recipe,
    planned once outside the timed call (as FlashInfer's plan is); `kernel` forces a multi-token kernel."""
    key, value = cache.layout(layout)
    query = case.last_rows() if decode else case.query
    cu_seqlens_q = None if decode else case.cu_seqlens_q
    out = torch.full_like(query, float("nan"))
    plan = ops.plan_paged_attention(key, cache.block_tables, cu_seqlens_q, query.shape[0], query.shape[1],
                                    fp8_math=fp8_math, kernel="auto" if decode else kernel)
    workspace = torch.empty(plan[0], dtype=torch.uint8, device=query.device)

    def run():
        ops.paged_attention(out, query, key, value, cache.block_tables, cache.seq_lens, cu_seqlens_q,
                            case.softmax_scale, cache.k_scale, cache.v_scale, hadamard=cache.hadamard,
                            k_offset=cache.k_offset, fp8_math=fp8_math, plan=plan, workspace=workspace)
        return out
    return run


def sdpa_column(case: PrefillCase, form: cases.SdpaForm):
    """One SDPA call per group; returns the groups' [B, Hq, q_len, D] outputs."""
    calls = []
    for g in case.groups:
        key, value = g.key, g.value
        if form.expanded:
            key, value = (cases.expand_heads(t, case.shape.model.num_heads) for t in (key, value))
        calls.append((g.batched(g.query), key, value))
    return lambda: [cases.sdpa(q, k, v, case.softmax_scale, form.backend) for q, k, v in calls]


def flashinfer_column(flashinfer, case: PrefillCase, layout: str, info: dict, fp8_query: bool = False):
    c = case.cache
    key, value = c.layout(layout)
    wrapped = flashinfer_baseline.Prefill(
        flashinfer, query=case.query, key_cache=key, value_cache=value, kv_layout=layout,
        block_tables=c.block_tables, seq_lens=c.seq_lens, cu_seqlens_q=case.cu_seqlens_q,
        softmax_scale=case.softmax_scale, k_scale=cases.K_SCALE, v_scale=cases.V_SCALE, fp8_query=fp8_query)
    info["setup_s"] = wrapped.setup_seconds
    return wrapped


def measure_shape(shape: PrefillShape, setup: common.Setup, seed: int) -> dict:
    ops, ops_reason, flashinfer = setup.ops, setup.ops_reason, setup.flashinfer
    case = make_case(shape, setup.device, seed)
    ref = case.reference_rows()
    rotated = cases.RotatedCopy(ops, case.cache, case.reference_rows)
    sdpa_to_rows = lambda outs: torch.cat([rows_of(out) for out in outs])

    def fp8kv(layout, decode=False, cache_of=lambda: case.cache, fp8_math=False):
        def build(info):
            if ops is None:
                raise RuntimeError(ops_reason)
            return fp8kv_column(ops, case, cache_of(), layout, decode, fp8_math, setup.kernel)
        return build

    columns = {}
    for fp8_math, plain, rotated_names in ((False, FP8KV_COLUMNS, ROTATED_COLUMNS),
                                           (True, FP8_MATH_COLUMNS, ROTATED_FP8_MATH_COLUMNS)):
        for name, layout in zip(plain, LAYOUTS):
            columns[name] = (fp8kv(layout, fp8_math=fp8_math), common.rel_err_check(ref))
        for name, layout in zip(rotated_names, LAYOUTS):
            columns[name] = (fp8kv(layout, cache_of=lambda: rotated.cache, fp8_math=fp8_math), rotated.check)
    for form in cases.sdpa_forms(shape.model.num_heads, shape.model.num_kv_heads):
        columns[form.name] = (lambda info, f=form: sdpa_column(case, f), common.rel_err_check(ref, sdpa_to_rows))
    if flashinfer is not None:
        for fp8_query in (False, True):
            for layout in LAYOUTS:
                name = FLASHINFER_PREFIX + (FLASHINFER_FP8_MATH if fp8_query else "") + layout
                columns[name] = (lambda info, l=layout, f=fp8_query: flashinfer_column(flashinfer, case, l, info, f),
                                 common.rel_err_check(ref))
    if shape.kind == "verify":
        last_rows_ref = case.groups[0].batched(ref)[:, :, -1]
        for name, layout in zip(DECODE_COLUMNS, LAYOUTS):
            columns[name] = (fp8kv(layout, decode=True), common.rel_err_check(last_rows_ref))
    results = {}
    for name, (build, check) in columns.items():
        results[name] = common.measure(build, check, setup.flush)
        common.add_rate(results[name], shape.flops, "tflops", 1e12)
    row = {"label": shape.label, "model": shape.model.name, "shape": dataclasses.asdict(shape), "kind": shape.kind,
           "flops": shape.flops, "columns": results}
    row["summary"] = summarize_row(row)
    row["targets"] = evaluate_targets(row)
    return row


def summarize_row(row: dict) -> dict:
    """fp8kv's faster storage (by graph time), the best baseline of each kind and the ratios, for the
    16-bit math, then the FP8 math's."""
    summary = sixteen_bit_summary(row)
    return summary | fp8_math_summary(row["columns"], summary)


def sixteen_bit_summary(row: dict) -> dict:
    cols = row["columns"]
    best = common.fastest(cols, FP8KV_COLUMNS, common.graph_us) or common.fastest(cols, FP8KV_COLUMNS)
    decode = common.fastest(cols, DECODE_COLUMNS, common.graph_us)
    summary = {"fp8kv_best": best, "decode_best": decode, "decode_us": decode and common.graph_us(cols[decode])}
    for key, prefix in (("sdpa_flash", SDPA_FLASH_PREFIX), ("sdpa", SDPA_PREFIX), ("flashinfer", FLASHINFER_PREFIX)):
        # FlashInfer's FA3 FP8 prefill (FP8 query) is the FP8 math's peer, not the 16-bit math's.
        name = common.fastest(cols, [n for n in cols if n.startswith(prefix) and not n.startswith(FLASHINFER_FA3_PREFIX)])
        summary[f"{key}_best"], summary[f"{key}_us"] = name, name and common.best_us(cols[name])
    summary |= common.rotated_attention_summary(cols, ROTATED_COLUMNS, best and common.graph_us(cols[best]))
    if best is None:
        return summary
    us = common.graph_us(cols[best])
    summary.update(fp8kv_launch_us=cols[best]["median_us"], fp8kv_graph_us=us,
                   max_fp8kv_rel_err=common.max_rel_err(cols, FP8KV_COLUMNS))
    if us is None:
        return summary
    summary["fp8kv_tflops"] = row["flops"] / (us * 1e-6) / 1e12
    for baseline in ("sdpa_flash", "sdpa", "flashinfer"):  # same FLOPs: time ratio = throughput ratio
        if summary[f"{baseline}_us"]:
            summary[f"{baseline}_vs_fp8kv"] = summary[f"{baseline}_us"] / us
    if summary["decode_us"]:
        summary["vs_decode"] = us / summary["decode_us"]
    return summary


def fp8_math_summary(cols: dict, summary: dict) -> dict:
    """The FP8-math columns: their faster storage by graph time, throughput, ratios against the fastest
    SDPA form, FlashInfer's FA3 FP8 prefill and fp8kv's 16-bit math, the worst error, and the rotated +
    centred recipe in FP8 math against the plain one."""
    best = common.fastest(cols, FP8_MATH_COLUMNS, common.graph_us)
    fa3 = common.fastest(cols, [n for n in cols if n.startswith(FLASHINFER_FA3_PREFIX)])
    out = {"fp8_math_best": best, "flashinfer_fa3_best": fa3, "flashinfer_fa3_us": fa3 and common.best_us(cols[fa3])}
    rotated = common.rotated_attention_summary(cols, ROTATED_FP8_MATH_COLUMNS, best and common.graph_us(cols[best]))
    out |= {f"fp8_math_{key}": value for key, value in rotated.items()}
    if best is None:
        return out
    us = common.graph_us(cols[best])
    out.update(fp8_math_graph_us=us, max_fp8_math_rel_err=common.max_rel_err(cols, FP8_MATH_COLUMNS))
    for key, baseline_us in (("sdpa", summary.get("sdpa_us")), ("flashinfer_fa3", out["flashinfer_fa3_us"]),
                             ("sixteen_bit", summary.get("fp8kv_graph_us"))):
        if baseline_us and us:
            out[f"{key}_vs_fp8_math"] = baseline_us / us
    return out


def fp8_math_sdpa_target(row: dict) -> float | None:
    """The FP8 math's target against the fastest SDPA form: prefill and chunked prefill only."""
    if row["kind"] not in ("prefill", "chunked prefill"):
        return None
    return TARGET_FP8_MATH_SDPA if row.get("model") == cases.LLAMA3_8B.name else TARGET_FP8_MATH_SDPA_OTHER_HEADS


def evaluate_targets(row: dict) -> dict[str, bool | None]:
    s, judge = row["summary"], common.judge
    flash, sdpa = s.get("sdpa_flash_vs_fp8kv"), s.get("sdpa_vs_fp8kv")
    fi, decode = s.get("flashinfer_vs_fp8kv"), s.get("vs_decode")
    targets = {
        f">={TARGET_SDPA_FLASH_THROUGHPUT}xSDPAflash": judge(lambda: flash >= TARGET_SDPA_FLASH_THROUGHPUT, flash),
        f">={TARGET_SDPA_THROUGHPUT}xSDPA": judge(lambda: sdpa >= TARGET_SDPA_THROUGHPUT, sdpa),
        f"FI>={TARGET_FLASHINFER_SLOWER}x": judge(lambda: fi >= TARGET_FLASHINFER_SLOWER, fi),
    }
    if row["kind"] == "verify":
        targets[f"<={TARGET_VERIFY_VS_DECODE}xdecode"] = judge(lambda: decode <= TARGET_VERIFY_VS_DECODE, decode)
    targets |= common.attention_error_targets(s, MAX_REL_ERR, TARGET_ROTATED_VS_PLAIN)
    sdpa_target, fp8_sdpa = fp8_math_sdpa_target(row), s.get("sdpa_vs_fp8_math")
    if sdpa_target is not None:
        targets[f"fp8>={sdpa_target}xSDPA"] = judge(lambda: fp8_sdpa >= sdpa_target, fp8_sdpa)
    fa3, err, rotated = s.get("flashinfer_fa3_vs_fp8_math"), s.get("max_fp8_math_rel_err"), s.get("fp8_math_rotated_vs_plain")
    targets[f"fp8>={TARGET_FP8_MATH_FLASHINFER}xFI3"] = judge(lambda: fa3 >= TARGET_FP8_MATH_FLASHINFER, fa3)
    targets[f"fp8_err<={MAX_FP8_MATH_REL_ERR:g}"] = judge(lambda: err <= MAX_FP8_MATH_REL_ERR, err)
    targets[f"fp8_{common.ROTATED}<={TARGET_ROTATED_VS_PLAIN}x"] = judge(lambda: rotated <= TARGET_ROTATED_VS_PLAIN,
                                                                          rotated)
    return targets


def table(rows: list[dict]) -> str:
    rot = common.ROTATED
    headers = ["shape", "NHD us", "HND us", "graph us", f"{rot} us", "xplain", "flash us", "SDPA us", "SDPA form",
               "FI us", "decode us", "TFLOP/s", "flash/fp8kv", "SDPA/fp8kv", "FI/fp8kv", "xdecode", "err", f"{rot} err",
               "fp8 us", "fp8 TFLOP/s", "SDPA/fp8", "FI3/fp8", "16bit/fp8", f"fp8 {rot}x", "fp8 err", "targets"]
    body = []
    for row in rows:
        cols, s = row["columns"], row["summary"]
        us = lambda name: common.fmt(cols.get(name, {}).get("median_us"))
        body.append([
            row["label"], us("fp8kv e4m3 NHD"), us("fp8kv e4m3 HND"), common.fmt(s.get("fp8kv_graph_us")),
            common.fmt(s.get("rotated_graph_us")), common.fmt(s.get("rotated_vs_plain"), 2),
            common.fmt(s.get("sdpa_flash_us")), common.fmt(s.get("sdpa_us")),
            s["sdpa_best"][len(SDPA_PREFIX):] if s.get("sdpa_best") else "-",
            common.fmt(s.get("flashinfer_us")), common.fmt(s.get("decode_us")), common.fmt(s.get("fp8kv_tflops")),
            common.fmt(s.get("sdpa_flash_vs_fp8kv"), 2), common.fmt(s.get("sdpa_vs_fp8kv"), 2),
            common.fmt(s.get("flashinfer_vs_fp8kv"), 2),
            common.fmt(s.get("vs_decode"), 2),
            common.fmt_err(s.get("max_fp8kv_rel_err")), common.fmt_err(s.get("max_rotated_rel_err")),
            common.fmt(s.get("fp8_math_graph_us")),
            common.fmt(s.get("fp8_math_graph_us") and row["flops"] / (s["fp8_math_graph_us"] * 1e-6) / 1e12),
            common.fmt(s.get("sdpa_vs_fp8_math"), 2), common.fmt(s.get("flashinfer_fa3_vs_fp8_math"), 2),
            common.fmt(s.get("sixteen_bit_vs_fp8_math"), 2), common.fmt(s.get("fp8_math_rotated_vs_plain"), 2),
            common.fmt_err(s.get("max_fp8_math_rel_err")),
            common.targets_text(row["targets"]),
        ])
    return common.format_table(headers, body)


def main() -> None:
    # --quick: these four are already few
    args, shapes, setup = common.start_run(__doc__.split("\n\n")[0], default_shapes(), default_shapes(), flashinfer=True,
                                           kernel_option=True)
    rows = common.measure_rows(shapes, lambda shape, index: measure_shape(shape, setup, seed=100 + index))
    plot = {"metric": "tflops", "ylabel": "attention TFLOP/s (causal, useful FLOPs)", "lines": {},
            "series": [common.FP8KV_SERIES, ["fp8kv e4m3 FP8 math (faster storage)", "@fp8_math_best"],
                       common.ROTATED_SERIES, ["bf16 SDPA flash", "@sdpa_flash_best"], common.SDPA_SERIES,
                       common.FLASHINFER_SERIES, ["fp8kv decode", "@decode_best"]],
            "relative_to": ["bf16 SDPA flash", "@sdpa_flash_best"]}
    common.finish_run("paged_attention_prefill", setup, rows, table, plot, args)


if __name__ == "__main__":
    main()
