"""Reading KV cache scales from a local checkpoint directory.

Two layers: `read_checkpoint_scales` (reading) gathers everything the checkpoint says about KV
cache scales (tensors, config hints, the legacy JSON file) and every problem with it, without
raising for bad content; `load_kv_cache_config` (per_rank) turns that into the `KVCacheConfig` of
one tensor-parallel rank and cache format, raising `CheckpointError` on any problem.
`CheckpointScales.report` describes the former (`python -m fp8kv inspect` prints it).
`checkpoint_tensor_names` (tensor_files) lists every tensor of a checkpoint and the file holding it;
`check_tensor_files` only checks those files (a damaged one, or a missing shard, is a CheckpointError).

Checkpoint forms: scale tensors (scale_tensors), config.json and hf_quant_config.json hints
(config), the legacy kv_cache_scales.json (legacy_json).

Checkpoints come from untrusted sources, so reading is bounded (files): regular files only (a
FIFO or device is an error, not a hang), JSON files and safetensors headers up to MAX_JSON_BYTES,
shard paths of the index inside the directory, and work proportional to the entries the files
hold, never to a count a file declares. Every safetensors header read must describe its file
(safetensors_layout): a truncated or corrupt file is one problem naming it, before any tensor is read.

An export into the directory that committed but did not finish its renames (a commit journal,
see `fp8kv.commit`) is read as finished: each file its journal lists is read from where the
journal says, so the checkpoint reads as the old one or the new one, never a mix.
"""

from .config import CONFIG_FILE, MAX_NUM_LAYERS, MODELOPT_FILE
from .files import MAX_JSON_BYTES, SafetensorsHeader, read_json_object, read_safetensors_header
from .legacy_json import LEGACY_JSON_FILE
from .per_rank import load_kv_cache_config, shard_kv_cache_config, shard_kv_heads
from .problems import CheckpointError, Problem
from .reading import CheckpointScales, read_checkpoint_scales
from .scale_tensors import FoundScale, module_and_layer, scale_values
from .tensor_files import INDEX_FILE, check_tensor_files, checkpoint_tensor_names
from .values import format_ranges

__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "MODELOPT_FILE",
    "LEGACY_JSON_FILE",
    "MAX_JSON_BYTES",
    "MAX_NUM_LAYERS",
    "Problem",
    "CheckpointError",
    "FoundScale",
    "CheckpointScales",
    "SafetensorsHeader",
    "read_safetensors_header",
    "read_json_object",
    "checkpoint_tensor_names",
    "check_tensor_files",
    "scale_values",
    "module_and_layer",
    "format_ranges",
    "read_checkpoint_scales",
    "shard_kv_cache_config",
    "shard_kv_heads",
    "load_kv_cache_config",
]
