"""When do calibrated e4m3 scales matter? A real model as it is, and with its K or V moved out of
e4m3's normal range by an exactly equivalent change of its weights.

e4m3 has the same relative precision (3 mantissa bits) everywhere in its normal range, 2^-6 .. 448,
so a scale only matters for values outside it: above 448 they saturate, below 2^-6 they become
subnormal and lose precision (below 2^-10 they round to zero). A trained model's K and V usually
sit well inside that range (SmolLM2-135M: max |K| about 20, max |V| about 15), and then scale 1 is as
good as a calibrated scale. To see the other case on the same model, `fp8kv.evaluate.rescale_kv`
multiplies K by `k_factor` (and divides the queries by it) or V by `v_factor` (and divides the output
projection by it): with powers of two the model's logits are bit for bit unchanged, only the K/V an
FP8 cache stores move. Variants:
- "as is";
- "K x 32": max |K| about 650, beyond 448: scale 1 saturates the largest keys;
- "V / 64": per-head max |V| about 0.006 .. 0.3, so most of V lies below 2^-6: scale 1 stores it as
  subnormals.

For each variant: e4m3 with scale 1, calibrated per tensor and per KV head on the evaluation windows
(fp8kv.calibration), scored by fp8kv.evaluate against the model's own SDPA attention (perplexity
change, KL, top-1, per-layer attention-output error).

    python benchmarks/accuracy_report.py [--model smollm2|DIR] [--data FILE ...] [--seq-len 256]
        [--windows 2] [--variants "as is" "K x 32" "V / 64"] [--device cpu|cuda] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from fp8kv import evaluate as ev
from fp8kv.models import LICENSE_TEXTS, SMOLLM2_NAME, evaluation_text

VARIANTS = {"as is": (1.0, 1.0), "K x 32": (32.0, 1.0), "V / 64": (1.0, 1 / 64)}
CACHES = ("e4m3", "e4m3-tensor", "e4m3-head")


def report_variant(model, windows: torch.Tensor, name: str, setup: dict) -> dict:
    """The variant's table and K/V maxima; the model is rescaled for it and restored (exactly) after."""
    k_factor, v_factor = VARIANTS[name]
    ev.rescale_kv(model, k_factor, v_factor)
    try:
        configs = ev.kv_cache_configs(model, windows, CACHES)
        del configs[ev.UNQUANTIZED]  # the same model function in every variant: see `python -m fp8kv evaluate`
        result = ev.evaluate_model(model, windows, configs, setup=dict(setup, variant=name))
    finally:
        ev.rescale_kv(model, 1 / k_factor, 1 / v_factor)
    calibrated = configs["e4m3-head"]
    max_finite = calibrated.dtype.max_finite
    return dict(variant=name, k_factor=k_factor, v_factor=v_factor,
                k_amax=max(max(s) for s in calibrated.k_scales) * max_finite,
                v_amax_range=(min(min(s) for s in calibrated.v_scales) * max_finite,
                              max(max(s) for s in calibrated.v_scales) * max_finite),
                result=result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=SMOLLM2_NAME, help=f"checkpoint directory or '{SMOLLM2_NAME}' (default)")
    parser.add_argument("--data", nargs="+", default=[str(p) for p in LICENSE_TEXTS],
                        help="text files (default: the license texts of /usr/share/common-licenses)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", choices=tuple(ev.DTYPES), default="bfloat16")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    start = time.perf_counter()
    plan = ev.prepare(ev.model_directory(args.model), evaluation_text(args.data), CACHES, seq_len=args.seq_len,
                      windows=args.windows, device=args.device, dtype=args.dtype)
    model = ev.load_model(plan)
    setup = {"model": str(plan.model_dir), "data": args.data, **ev.environment(plan)}
    reports = [report_variant(model, plan.windows, name, setup) for name in args.variants]
    for report in reports:
        low, high = report["v_amax_range"]
        print(f"\n### {report['variant']}: max |K| {report['k_amax']:.4g}, per-head max |V| {low:.3g} .. {high:.3g}\n")
        print(report["result"].table())
    print(f"\n{time.perf_counter() - start:.0f} s")
    if args.json:
        for report in reports:
            report["result"] = report["result"].to_json()
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=2)


if __name__ == "__main__":
    main()
