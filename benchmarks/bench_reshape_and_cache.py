"""FP8 cache write: fp8kv's reshape_and_cache against quantize-and-scatter in PyTorch ops.

Tokens (>= 16k) of bf16 K and V of Llama-3-8B (8 KV heads of 128) are quantized to e4m3 and scattered
to slots of a paged cache whose blocks are a random permutation (each sequence's tokens fill its
blocks in order, as in prefill). Inputs are contiguous, or K/V slices of a fused QKV tensor (32 query
heads). Scales make about 0.05% of the values saturate. Each column's cache bytes are compared with
the reference (PyTorch's saturate-then-cast, round to nearest even) before timing: any mismatched
byte fails the row. Every column runs as a plain launch and replayed from a CUDA graph.

The same K/V are also written with the rotated + centred recipe (docs/rotated_cache.md) in the same
two storages ("fp8kv rotated+centred NHD/HND"): mu is the mean of the rotated K per KV head and
channel, the scales the rotated (K: centred) values' maxima / 448, measured with torch. Their bytes
are compared with those of fp8kv's CPU kernel on the same inputs (the recipe's bytes are specified
step by step, the same on every backend, and the CPU kernel's are tested against an independent
reference).

Bandwidth = bytes read (K, V, slot mapping) + bytes written (FP8 K, V) / time. Targets (judged on the
CUDA-graph time of fp8kv's faster storage): >= 2/3 of the device-to-device copy bandwidth measured in
the same run (which also counts bytes read + written), i.e. ~2.0 TB/s on an H100; the rotated +
centred write (its faster storage) <= 1.15x the plain write's time; exact bytes for both recipes.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

import attention_cases as cases
import common

TARGET_COPY_FRACTION = 2 / 3
TARGET_ROTATED_VS_PLAIN = 1.15
WRITE_K_SCALE, WRITE_V_SCALE = 2.0**-7, 2.0**-7  # N(0, 1) / 2^-7 exceeds 448 at 3.5 sigma
EMPTY_CACHE_BYTE = common.POISON_BYTE  # what an unwritten slot holds, before and after a graph's poisoning
LAYOUTS = ("NHD", "HND")
FP8KV_COLUMNS = ("fp8kv NHD", "fp8kv HND")
ROTATED_COLUMNS = ("fp8kv rotated+centred NHD", "fp8kv rotated+centred HND")
TORCH_COLUMN = "torch quantize+index_copy"


@dataclasses.dataclass(frozen=True)
class WriteShape:
    tokens: int
    model: cases.Model = cases.LLAMA3_8B
    block_size: int = 16
    fused_qkv: bool = False  # K and V are slices of one [tokens, Hq + 2 Hkv, D] projection output

    @property
    def label(self) -> str:
        source = " from fused QKV" if self.fused_qkv else ""
        return f"{self.model.name} write {cases.tokens_text(self.tokens)} tokens{source}"

    @property
    def bytes_moved(self) -> int:
        elements = 2 * self.tokens * self.model.num_kv_heads * self.model.head_size  # K and V
        return elements * 2 + 8 * self.tokens + elements * 1  # bf16 read, int64 slots, e4m3 written


def default_shapes() -> list[WriteShape]:
    return [WriteShape(16384), WriteShape(131072), WriteShape(131072, fused_qkv=True)]


@dataclasses.dataclass
class WriteCase:
    shape: WriteShape
    key: torch.Tensor  # [N, H, D] bf16 (maybe a slice)
    value: torch.Tensor
    slot_mapping: torch.Tensor  # int64 [N]
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    expected_key: torch.Tensor  # the cache bytes a correct write leaves, NHD
    expected_value: torch.Tensor
    hadamard: bool = False  # the rotated recipe: rows rotated by the block Hadamard matrix H
    k_offset: torch.Tensor | None = None  # float32 [num_kv_heads, head_size]: mu, taken from the rotated K


def quantize_scatter(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor) -> None:
    """The PyTorch-ops path: quantize every row (saturate, then cast) and scatter it to its slot."""
    fmax = torch.finfo(cache.dtype).max
    codes = (rows.float() / scale).clamp_(-fmax, fmax).to(cache.dtype)
    cache.view(torch.uint8).view(-1, *rows.shape[1:]).index_copy_(0, slots, codes.view(torch.uint8))


def make_case(shape: WriteShape, device: torch.device, seed: int) -> WriteCase:
    gen = torch.Generator(device).manual_seed(seed)
    hq, h, d, n = shape.model.num_heads, shape.model.num_kv_heads, shape.model.head_size, shape.tokens
    if shape.fused_qkv:
        qkv = torch.randn(n, hq + 2 * h, d, generator=gen, device=device).to(torch.bfloat16)
        key, value = qkv[:, hq:-h], qkv[:, -h:]
    else:
        key, value = (torch.randn(n, h, d, generator=gen, device=device).to(torch.bfloat16) for _ in range(2))
    num_blocks = -(-n // shape.block_size)
    blocks = torch.randperm(num_blocks, generator=gen, device=device)
    positions = torch.arange(n, device=device)
    slot_mapping = blocks[positions // shape.block_size] * shape.block_size + positions % shape.block_size
    k_scale = torch.tensor([WRITE_K_SCALE], device=device)
    v_scale = torch.tensor([WRITE_V_SCALE], device=device)
    expected = []
    for rows, scale in ((key, k_scale), (value, v_scale)):
        cache = empty_cache(shape, num_blocks, device)
        quantize_scatter(cache, rows, slot_mapping, scale)
        expected.append(cache)
    return WriteCase(shape, key, value, slot_mapping, k_scale, v_scale, *expected)


def rotated_case(ops, case: WriteCase) -> WriteCase:
    """The case's K/V under the rotated + centred recipe: its parameters measured from them with torch,
    and the bytes a correct write leaves from fp8kv's CPU kernel."""
    recipe = cases.centred_recipe(case.key, case.value)
    cpu = torch.device("cpu")
    expected = [empty_cache(case.shape, case.expected_key.shape[0], cpu) for _ in range(2)]
    ops.reshape_and_cache(case.key.cpu(), case.value.cpu(), *expected, case.slot_mapping.cpu(), recipe.k_scale.cpu(),
                          recipe.v_scale.cpu(), hadamard=True, k_offset=recipe.k_offset.cpu())
    device = case.key.device
    return dataclasses.replace(case, k_scale=recipe.k_scale, v_scale=recipe.v_scale, hadamard=True,
                               k_offset=recipe.k_offset, expected_key=expected[0].to(device),
                               expected_value=expected[1].to(device))


def empty_cache(shape: WriteShape, num_blocks: int, device: torch.device, layout: str = "NHD") -> torch.Tensor:
    """A cache of EMPTY_CACHE_BYTE in the given storage, as the logical [blocks, block, heads, dim] view."""
    cache = torch.full((num_blocks, shape.block_size, shape.model.num_kv_heads, shape.model.head_size),
                       EMPTY_CACHE_BYTE, dtype=torch.uint8, device=device).view(cases.CACHE_DTYPE)
    return cases.hnd_storage(cache) if layout == "HND" else cache


def mismatch_check(case: WriteCase, key_cache: torch.Tensor, value_cache: torch.Tensor) -> dict:
    """The number of cache bytes that differ from those the case expects."""
    mismatched = sum(int((got.view(torch.uint8) != want.view(torch.uint8)).sum())
                     for got, want in ((key_cache, case.expected_key), (value_cache, case.expected_value)))
    return {"mismatched_bytes": mismatched}


def measure_shape(shape: WriteShape, setup: common.Setup, seed: int) -> dict:
    ops, ops_reason, device = setup.ops, setup.ops_reason, setup.device
    case = make_case(shape, device, seed)
    num_blocks = case.expected_key.shape[0]

    def fp8kv_ops():
        if ops is None:
            raise RuntimeError(ops_reason)
        return ops

    # Made when a rotated column first needs it: where fp8kv refuses the recipe, those columns say why.
    rotated = functools.cache(lambda: rotated_case(fp8kv_ops(), case))

    def column(case_of, write, layout="NHD"):
        """A column writing case_of()'s K/V into fresh empty caches; its output is the caches, checked
        byte for byte against those the case expects."""
        key_cache, value_cache = (empty_cache(shape, num_blocks, device, layout) for _ in range(2))

        def build(info):
            written = case_of()

            def run():
                write(written, key_cache, value_cache)
                return key_cache, value_cache
            return run
        return build, lambda caches: mismatch_check(case_of(), *caches)

    def fp8kv_write(written, key_cache, value_cache):
        fp8kv_ops().reshape_and_cache(written.key, written.value, key_cache, value_cache, written.slot_mapping,
                                      written.k_scale, written.v_scale, hadamard=written.hadamard,
                                      k_offset=written.k_offset)

    def torch_write(written, key_cache, value_cache):
        quantize_scatter(key_cache, written.key, written.slot_mapping, written.k_scale)
        quantize_scatter(value_cache, written.value, written.slot_mapping, written.v_scale)

    plain = lambda: case
    columns = {name: column(plain, fp8kv_write, layout) for name, layout in zip(FP8KV_COLUMNS, LAYOUTS)}
    columns |= {name: column(rotated, fp8kv_write, layout) for name, layout in zip(ROTATED_COLUMNS, LAYOUTS)}
    columns[TORCH_COLUMN] = column(plain, torch_write)
    results = {}
    for name, (build, check) in columns.items():
        results[name] = common.measure(build, check, setup.flush)
        common.add_rate(results[name], shape.bytes_moved, "eff_tb_s", common.TB)
    row = {"label": shape.label, "shape": dataclasses.asdict(shape), "bytes": shape.bytes_moved, "columns": results}
    row["summary"] = summarize_row(row, setup.ceilings)
    row["targets"] = evaluate_targets(row)
    return row


def mismatched_bytes(cols: dict, names) -> int:
    """Mismatched bytes of the named columns that ran, launch and graph."""
    return sum(cols[n].get("mismatched_bytes", 0) + cols[n].get("graph", {}).get("mismatched_bytes", 0)
               for n in names if "median_us" in cols.get(n, {}))


def summarize_row(row: dict, ceilings: dict) -> dict:
    """fp8kv's faster storage by graph time, its bandwidth and fraction of the copy bandwidth; the
    rotated + centred write's faster storage and its time relative to the plain write's."""
    cols = row["columns"]
    best = common.fastest(cols, FP8KV_COLUMNS, common.graph_us)
    rotated = common.rotated_summary(cols, ROTATED_COLUMNS, best and common.graph_us(cols[best]))
    if rotated["rotated_best"]:
        rotated["rotated_mismatched_bytes"] = mismatched_bytes(cols, ROTATED_COLUMNS)
    if best is None:
        return {"fp8kv_best": None} | rotated
    return ({"fp8kv_best": best, "mismatched_bytes": mismatched_bytes(cols, FP8KV_COLUMNS)} | rotated
            | common.bandwidth_summary(row, best, ceilings["copy_tb_s"], "fraction_of_copy", TORCH_COLUMN))


def evaluate_targets(row: dict) -> dict[str, bool | None]:
    s, judge = row["summary"], common.judge
    fraction, mismatched = s.get("fraction_of_copy"), s.get("mismatched_bytes")
    rotated_mismatched = s.get("rotated_mismatched_bytes")
    return ({f">={TARGET_COPY_FRACTION:.0%}copy": judge(lambda: fraction >= TARGET_COPY_FRACTION, fraction),
             "exact": judge(lambda: mismatched == 0, mismatched)}
            | common.rotated_ratio_target(s, TARGET_ROTATED_VS_PLAIN)
            | {f"{common.ROTATED}_exact": judge(lambda: rotated_mismatched == 0, rotated_mismatched)})


def table(rows: list[dict]) -> str:
    headers = [*common.layout_headers("MB moved"), "torch us", "TB/s", "%copy", "xtorch", "bad bytes",
               f"{common.ROTATED} bad", "targets"]
    body = []
    for row in rows:
        cols, s = row["columns"], row["summary"]
        body.append([
            *common.layout_cells(row, row["bytes"], "fp8kv NHD", "fp8kv HND"),
            common.fmt(common.best_us(cols.get(TORCH_COLUMN, {}))),
            common.fmt(s.get("fp8kv_tb_s"), 2),
            common.fmt(100 * s["fraction_of_copy"] if "fraction_of_copy" in s else None, 0),
            common.fmt(s.get("vs_baseline"), 2), str(s.get("mismatched_bytes", "-")),
            str(s.get("rotated_mismatched_bytes", "-")), common.targets_text(row["targets"]),
        ])
    return common.format_table(headers, body)


def main() -> None:
    args, shapes, setup = common.start_run(__doc__.split("\n\n")[0], default_shapes(), default_shapes()[:1])
    rows = common.measure_rows(shapes, lambda shape, index: measure_shape(shape, setup, seed=200 + index))
    copy_tb_s = setup.ceilings["copy_tb_s"]
    plot = {"metric": "eff_tb_s", "ylabel": "bytes read + written / time (TB/s)",
            "lines": {"copy": copy_tb_s, f"{TARGET_COPY_FRACTION:.0%} of copy": TARGET_COPY_FRACTION * copy_tb_s},
            "series": [[name, name] for name in (*FP8KV_COLUMNS, *ROTATED_COLUMNS, TORCH_COLUMN)]}
    common.finish_run("reshape_and_cache", setup, rows, table, plot, args)


if __name__ == "__main__":
    main()
