"""Calibration maxima: fp8kv's kv_amax against PyTorch's one-pass inf-norm reduction.

bf16 K and V of Llama-3-8B (8 KV heads of 128), contiguous or sliced out of a fused QKV tensor (32
query heads), per tensor ([1] maxima) and per KV head ([num_kv_heads] maxima). Each column's maxima
are compared with max(|x|) computed by PyTorch (exact: a maximum has no rounding) before timing.
Every column runs as a plain launch and replayed from a CUDA graph.

Bandwidth = K and V bytes read / time. Target (judged on fp8kv's CUDA-graph time): >= 2/3 of the
read-only bandwidth measured in the same run, i.e. ~2.0 TB/s on an H100.
"""

from __future__ import annotations

import dataclasses

import torch

import attention_cases as cases
import common

TARGET_READ_FRACTION = 2 / 3
FP8KV_COLUMN, TORCH_COLUMN = "fp8kv", "torch inf-norm"


@dataclasses.dataclass(frozen=True)
class AmaxShape:
    tokens: int
    per_head: bool
    model: cases.Model = cases.LLAMA3_8B
    fused_qkv: bool = False  # K and V are slices of one [tokens, Hq + 2 Hkv, D] projection output

    @property
    def label(self) -> str:
        granularity = "per head" if self.per_head else "per tensor"
        source = " from fused QKV" if self.fused_qkv else ""
        return f"{self.model.name} amax {cases.tokens_text(self.tokens)} tokens {granularity}{source}"

    @property
    def bytes_read(self) -> int:
        return 2 * self.tokens * self.model.num_kv_heads * self.model.head_size * 2  # K and V, bf16


def default_shapes() -> list[AmaxShape]:
    shapes = [AmaxShape(n, per_head) for n in (16384, 262144) for per_head in (False, True)]
    return shapes + [AmaxShape(262144, True, fused_qkv=True)]


def make_inputs(shape: AmaxShape, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device).manual_seed(seed)
    hq, h, d, n = shape.model.num_heads, shape.model.num_kv_heads, shape.model.head_size, shape.tokens
    if shape.fused_qkv:
        qkv = torch.randn(n, hq + 2 * h, d, generator=gen, device=device).to(torch.bfloat16)
        return qkv[:, hq:-h], qkv[:, -h:]
    return tuple(torch.randn(n, h, d, generator=gen, device=device).to(torch.bfloat16) for _ in range(2))


def torch_amax(x: torch.Tensor, per_head: bool) -> torch.Tensor:
    """max |x| in one reduction pass (the inf-norm), float32, shaped like fp8kv's maxima."""
    if per_head:
        return torch.linalg.vector_norm(x, ord=float("inf"), dim=(0, 2), dtype=torch.float32)
    return torch.linalg.vector_norm(x, ord=float("inf"), dtype=torch.float32).reshape(1)


def exact_check(expected: tuple[torch.Tensor, torch.Tensor], maxima: tuple[torch.Tensor, torch.Tensor] | None = None):
    """A check that the maxima equal `expected`: the call's output, or the given running-maximum
    buffers (fp8kv folds into them, so they are not an output to poison with NaN between replays)."""
    return lambda output: {"exact": all(bool(torch.equal(g, e)) for g, e in zip(maxima or output, expected))}


def measure_shape(shape: AmaxShape, setup: common.Setup, seed: int) -> dict:
    ops, ops_reason, device = setup.ops, setup.ops_reason, setup.device
    key, value = make_inputs(shape, device, seed)
    expected = (torch_amax(key, shape.per_head), torch_amax(value, shape.per_head))
    count = shape.model.num_kv_heads if shape.per_head else 1
    k_amax, v_amax = (torch.zeros(count, dtype=torch.float32, device=device) for _ in range(2))

    def fp8kv(info):
        if ops is None:
            raise RuntimeError(ops_reason)
        # kv_amax folds into the running maxima (zeros here): repeating the call is idempotent.
        return lambda: ops.kv_amax(key, value, k_amax, v_amax)

    def torch_path():
        return torch_amax(key, shape.per_head), torch_amax(value, shape.per_head)

    results = {FP8KV_COLUMN: common.measure(fp8kv, exact_check(expected, (k_amax, v_amax)), setup.flush),
               TORCH_COLUMN: common.measure(lambda info: torch_path, exact_check(expected), setup.flush)}
    for column in results.values():
        common.add_rate(column, shape.bytes_read, "eff_tb_s", common.TB)
    row = {"label": shape.label, "shape": dataclasses.asdict(shape), "bytes": shape.bytes_read, "columns": results}
    row["summary"] = summarize_row(row, setup.ceilings)
    row["targets"] = evaluate_targets(row)
    return row


def summarize_row(row: dict, ceilings: dict) -> dict:
    """fp8kv's graph time, its bandwidth and fraction of the read-only bandwidth, its exactness."""
    fp8kv = row["columns"][FP8KV_COLUMN]
    if common.graph_us(fp8kv) is None:
        return {}
    return ({"exact": fp8kv["exact"] and fp8kv["graph"]["exact"]}
            | common.bandwidth_summary(row, FP8KV_COLUMN, ceilings["read_tb_s"], "fraction_of_read", TORCH_COLUMN))


def evaluate_targets(row: dict) -> dict[str, bool | None]:
    s = row["summary"]
    fraction, exact = s.get("fraction_of_read"), s.get("exact")
    return {f">={TARGET_READ_FRACTION:.0%}read": common.judge(lambda: fraction >= TARGET_READ_FRACTION, fraction),
            "exact": common.judge(lambda: exact, exact)}


def table(rows: list[dict]) -> str:
    headers = ["shape", "MB read", "fp8kv us", "graph us", "torch us", "TB/s", "%read", "xtorch", "targets"]
    body = []
    for row in rows:
        cols, s = row["columns"], row["summary"]
        body.append([
            row["label"], f"{row['bytes'] / 1e6:.0f}", common.fmt(cols[FP8KV_COLUMN].get("median_us")),
            common.fmt(s.get("fp8kv_graph_us")), common.fmt(common.best_us(cols[TORCH_COLUMN])),
            common.fmt(s.get("fp8kv_tb_s"), 2),
            common.fmt(100 * s["fraction_of_read"] if "fraction_of_read" in s else None, 0),
            common.fmt(s.get("vs_baseline"), 2), common.targets_text(row["targets"]),
        ])
    return common.format_table(headers, body)


def main() -> None:
    args, shapes, setup = common.start_run(__doc__.split("\n\n")[0], default_shapes(), default_shapes()[2:4])
    rows = common.measure_rows(shapes, lambda shape, index: measure_shape(shape, setup, seed=300 + index))
    read_tb_s = setup.ceilings["read_tb_s"]
    plot = {"metric": "eff_tb_s", "ylabel": "bytes read / time (TB/s)",
            "lines": {"read": read_tb_s, f"{TARGET_READ_FRACTION:.0%} of read": TARGET_READ_FRACTION * read_tb_s},
            "series": [[FP8KV_COLUMN, FP8KV_COLUMN], [TORCH_COLUMN, TORCH_COLUMN]]}
    common.finish_run("kv_amax", setup, rows, table, plot, args)


if __name__ == "__main__":
    main()
