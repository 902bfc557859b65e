"""`fp8kv inspect`: what a checkpoint says about its KV cache scales (CheckpointScales.report)."""

from __future__ import annotations

import argparse

from ..checkpoint.reading import read_checkpoint_scales
from .errors import blame

HELP = "show a checkpoint's KV cache scales and every problem with them"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="local checkpoint directory (config.json + safetensors)")
    parser.add_argument("--scales-json", help="a legacy kv_cache_scales.json outside the checkpoint")


def run(args: argparse.Namespace) -> int:
    """Prints what a checkpoint says about its KV cache scales; exit status 1 if anything is wrong."""
    with blame("checkpoint"):
        found = read_checkpoint_scales(args.checkpoint, scales_json=args.scales_json)
    print("\n".join(found.report()))
    return 1 if found.problems else 0
