"""Calibration: the K/V maxima of a model over data, turned into scales and written into its checkpoint.

    amax = calibrate(model, batches, granularity="head")        # transformers model, token batches
    kv_cache = amax.scales("float8_e4m3fn")                       # s = amax / 448, a KVCacheConfig
    export_checkpoint(model_dir, out_dir, kv_cache)               # k_scale/v_scale + kv_cache_scheme

or all at once, from a checkpoint directory (what `python -m fp8kv calibrate` runs):

    result = calibrate_checkpoint(model_dir, batches, out_dir, granularity="head")
    print(result.summary())                                       # per-layer maxima and scales, files

Modules, bottom to top:
- `scales`: `KVAmax.scales` turns maxima into dequantization scales s = amax * margin /
  max_finite(format), refusing NaN/inf maxima and all-zero heads (or giving those scale 1.0 when
  asked to) by name.
- `observe`: `KVCalibrator` keeps one running maximum per layer (per tensor or per KV head) and
  folds each step's K/V into it with `fp8kv.ops.kv_amax` on the K/V's device, never synchronizing
  with the host; `result()` reduces across tensor-parallel ranks (fp8kv.distributed) into a
  `KVAmax`. `calibrate` / `observe_model` drive a transformers model: a DynamicCache subclass sees
  every layer's K (after rotary embedding, exactly as it is cached) and V.
- `data`: `text_sequences` (a text file and the model's tokenizer) or `token_id_sequences` (a file
  of ids), cut by `make_batches`.
- `export`: `export_checkpoint` writes the scales as `P.k_scale` / `P.v_scale` float32 tensors in
  the shapes llm-compressor writes ([1] per tensor, [num_kv_heads, 1, 1] per head), in an added
  shard registered in the index (sharded checkpoints) or in model.safetensors (single-file ones),
  and declares them in config.json as a compressed-tensors `kv_cache_scheme`;
  `export_legacy_json` writes the legacy kv_cache_scales.json. Both write all or nothing through
  `fp8kv.commit` (whose journal the checkpoint loader also reads: a committed export reads as done).
- `pipeline`: `calibrate_checkpoint` loads a transformers checkpoint, calibrates, makes the scales
  and exports them; its `CheckpointCalibration` result holds the maxima, the scales, the files.
"""

from .data import make_batches, text_sequences, token_id_sequences
from .export import SCALES_FILE, SINGLE_FILE, export_checkpoint, export_legacy_json, scales_file
from .observe import GRANULARITIES, KVCalibrator, calibrate, observe_model
from .pipeline import CheckpointCalibration, calibrate_checkpoint
from .scales import ZERO_AMAX_POLICIES, CalibrationError, KVAmax

__all__ = [
    "CalibrationError",
    "CheckpointCalibration",
    "GRANULARITIES",
    "KVAmax",
    "KVCalibrator",
    "SCALES_FILE",
    "SINGLE_FILE",
    "ZERO_AMAX_POLICIES",
    "calibrate",
    "calibrate_checkpoint",
    "export_checkpoint",
    "export_legacy_json",
    "make_batches",
    "observe_model",
    "scales_file",
    "text_sequences",
    "token_id_sequences",
]
