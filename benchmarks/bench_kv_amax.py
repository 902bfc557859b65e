"""Calibration maxima (issue 3): fp8kv's kv_amax against PyTorch's one-pass inf-norm reduction.

bf16 K and V of 8 KV heads, contiguous or sliced out of a fused QKV tensor (32 query heads), per
tensor ([1] maxima) and per KV head ([num_kv_heads] maxima). Each column's maxima are compared once
with max(|x|) computed by PyTorch (exact: a maximum has no rounding) before timing.

Bandwidth = K and V bytes read / median time. Target (issue 3): >= 2.0 TB/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc

import torch

import common

TARGET_BW = 2.0e12
QUERY_HEADS_IN_FUSED_QKV = 32


@dataclasses.dataclass(frozen=True)
class AmaxShape:
    tokens: int
    per_head: bool
    num_kv_heads: int = 8
    head_size: int = 128
    fused_qkv: bool = False

    @property
    def label(self) -> str:
        granularity = "per-head" if self.per_head else "per-tensor"
        source = " qkv-slices" if self.fused_qkv else ""
        return f"N{self.tokens} h{self.num_kv_heads} d{self.head_size} {granularity}{source}"

    @property
    def bytes_read(self) -> int:
        return 2 * self.tokens * self.num_kv_heads * self.head_size * 2  # K and V, bf16


def issue_shapes() -> list[AmaxShape]:
    shapes = [AmaxShape(n, per_head) for n in (16384, 262144) for per_head in (False, True)]
    return shapes + [AmaxShape(262144, True, fused_qkv=True)]


def make_inputs(shape: AmaxShape, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device).manual_seed(seed)
    h, d, n = shape.num_kv_heads, shape.head_size, shape.tokens
    if shape.fused_qkv:
        qkv = torch.randn(n, QUERY_HEADS_IN_FUSED_QKV + 2 * h, d, generator=gen, device=device).to(torch.bfloat16)
        return qkv[:, QUERY_HEADS_IN_FUSED_QKV:-h], qkv[:, -h:]
    return tuple(torch.randn(n, h, d, generator=gen, device=device).to(torch.bfloat16) for _ in range(2))


def torch_amax(x: torch.Tensor, per_head: bool) -> torch.Tensor:
    """max |x| in one reduction pass (the inf-norm), float32, shaped like fp8kv's maxima."""
    if per_head:
        return torch.linalg.vector_norm(x, ord=float("inf"), dim=(0, 2), dtype=torch.float32)
    return torch.linalg.vector_norm(x, ord=float("inf"), dtype=torch.float32).reshape(1)


def exact_check(expected: tuple[torch.Tensor, torch.Tensor]):
    def check(got):
        return {"exact": all(bool(torch.equal(g, e)) for g, e in zip(got, expected))}
    return check


def measure_shape(shape: AmaxShape, ops, ops_reason: str, device, flush, seed: int) -> dict:
    key, value = make_inputs(shape, device, seed)
    expected = (torch_amax(key, shape.per_head), torch_amax(value, shape.per_head))
    count = shape.num_kv_heads if shape.per_head else 1

    def fp8kv(info):
        if ops is None:
            raise RuntimeError(ops_reason)
        k_amax, v_amax = (torch.zeros(count, dtype=torch.float32, device=device) for _ in range(2))

        def run():
            ops.kv_amax(key, value, k_amax, v_amax)  # folds into the running maxima: idempotent here
            return k_amax, v_amax
        return run

    results = {
        "fp8kv": common.measure(fp8kv, exact_check(expected), flush),
        "torch inf-norm": common.measure(
            lambda info: lambda: (torch_amax(key, shape.per_head), torch_amax(value, shape.per_head)),
            exact_check(expected), flush),
    }
    for info in results.values():
        if "median_us" in info:
            info["eff_tb_s"] = shape.bytes_read / (info["median_us"] * 1e-6) / common.TB
    del key, value
    gc.collect()
    torch.cuda.empty_cache()
    return {"label": shape.label, "shape": dataclasses.asdict(shape), "bytes": shape.bytes_read, "columns": results}


def evaluate_targets(row: dict) -> dict[str, bool | None]:
    col = row["columns"]["fp8kv"]
    if "median_us" not in col:
        return {">=2.0TB/s": None, "exact": None}
    return {">=2.0TB/s": col["eff_tb_s"] * common.TB >= TARGET_BW, "exact": col["exact"]}


def table(rows: list[dict], read_tb_s: float) -> str:
    headers = ["shape", "MB read", "fp8kv us", "torch us", "TB/s", "%read", "xtorch", "targets"]
    body = []
    for row in rows:
        fp8kv, ref = row["columns"]["fp8kv"], row["columns"]["torch inf-norm"]
        bw = fp8kv.get("eff_tb_s")
        ratio = fp8kv["median_us"] / ref["median_us"] if "median_us" in fp8kv and "median_us" in ref else None
        body.append([
            row["label"], f"{row['bytes'] / 1e6:.0f}", common.fmt(fp8kv.get("median_us")),
            common.fmt(ref.get("median_us")), common.fmt(bw, 2),
            common.fmt(100 * bw / read_tb_s if bw else None, 0), common.fmt(ratio, 2),
            " ".join(f"{k}:{common.verdict(v)}" for k, v in row["targets"].items()),
        ])
    return common.format_table(headers, body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_arguments(parser)
    args = parser.parse_args()
    shapes = common.select_shapes(issue_shapes()[2:4] if args.quick else issue_shapes(), args.shapes)
    device = common.cuda_device_or_exit()
    ops, ops_reason = common.load_fp8kv()
    print(f"fp8kv: {ops_reason}")
    flush = common.L2Flush(device)
    ceilings = common.measure_ceilings(device, flush).as_dict()
    rows = []
    for index, shape in enumerate(shapes):
        row = measure_shape(shape, ops, ops_reason, device, flush, seed=300 + index)
        row["targets"] = evaluate_targets(row)
        rows.append(row)
    print(f"device read-only sum {ceilings['read_tb_s']:.2f} TB/s, copy {ceilings['copy_tb_s']:.2f} TB/s")
    print(table(rows, ceilings["read_tb_s"]))
    for row in rows:
        for name, col in row["columns"].items():
            if "error" in col:
                print(f"  {row['label']} / {name}: {col['error']}")
    payload = common.run_header("kv_amax", device) | {
        "ceilings": ceilings, "fp8kv": ops_reason, "rows": rows,
        "plot": {"metric": "eff_tb_s", "ylabel": "bytes read / time (TB/s)",
                 "lines": {"read": ceilings["read_tb_s"], "target 2.0": TARGET_BW / common.TB},
                 "series": [["fp8kv", "fp8kv"], ["torch inf-norm", "torch inf-norm"]]},
    }
    common.write_outputs(payload, args)


if __name__ == "__main__":
    main()
