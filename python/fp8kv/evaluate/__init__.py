"""How much an FP8 KV cache changes a model's predictions on real text: `python -m fp8kv evaluate`.

    result = evaluate(model_dir, text, ["e4m3", "e4m3-head", "e5m2"], seq_len=2048, windows=16)
    print(result.table())

The text is tokenized and cut into `windows` windows of `seq_len` tokens (each starting with the
tokenizer's BOS token, as `fp8kv.calibration.text_sequences` cuts calibration text). For each KV
cache the model runs teacher-forced over every window in one forward pass through fp8kv's
transformers integration: each layer writes the window's K/V into a `PagedCache` (quantized with
the layer's scales) and attends over it, so every position reads the cached K/V of itself and the
positions before it, as at inference. The reference is the model's own attention: transformers'
SDPA with its dense cache, in the same dtype, on the same windows.

Metrics, over every predicted token of every window:
- perplexity of the text, and its change against the model's own;
- KL(model || cache) of the next-token distributions, mean per token;
- top-1 agreement: how often the cache's most likely next token is the model's;
- per layer: relative Frobenius error ||out - ref|| / ||ref|| of the attention module's output
  (forward hooks), over all windows. A layer's inputs already carry the earlier layers' errors.

Caches: `auto`, the unquantized paged cache in the model's dtype (always evaluated: it separates the
integration's own rounding from the format's), and caches named FORMAT[-RECIPE][-SOURCE] (caches): an
FP8 format by any of its names, in the rotated recipe (left out), `plain` or `centred`, with scale 1,
a checkpoint's scales (`-checkpoint`), or scales calibrated on the evaluation windows per tensor or
per KV head (`-tensor`, `-head`, through `fp8kv.calibration`). By default CACHES. `e4m3` is e4m3fn
(e4m3fnuz on MI300, as in vLLM); results name each cache canonically (`float8_e4m3fn-plain-head`).

Each window runs the model's own attention once, then every cache: a cache's scores are final after
its pass of the last window (`python -m fp8kv evaluate` prints each row then, through `on_row`).
Interrupted (Ctrl-C; SIGTERM in the command), `EvaluationInterrupted` carries every cache's scores
over the windows completed, which the command prints and writes (--json) before it exits with 130.

Modules: pipeline (checks, tokenization, loading, `evaluate`), caches (the caches by name),
metrics (the scores and the loop measuring them), results, rescale, plot. The command line is
`fp8kv.commands.evaluate`.
"""

from .caches import CACHES, SOURCES, UNQUANTIZED, cache_name, kv_cache_configs, label, per_tensor
from .metrics import (AttentionOutputs, EvaluationInterrupted, LayerErrors, LogitScores, ReferenceLogits,
                      attention_modules, evaluate_model)
from .pipeline import (DTYPES, check_options, environment, evaluate, load_model, model_directory, prepare,
                       token_windows)
from .plot import plot_layer_errors
from .rescale import rescale_kv
from .results import CacheResult, EvaluationResult

__all__ = [
    "UNQUANTIZED",
    "CACHES",
    "SOURCES",
    "cache_name",
    "label",
    "DTYPES",
    "CacheResult",
    "EvaluationResult",
    "LogitScores",
    "ReferenceLogits",
    "LayerErrors",
    "attention_modules",
    "AttentionOutputs",
    "evaluate_model",
    "EvaluationInterrupted",
    "token_windows",
    "per_tensor",
    "kv_cache_configs",
    "rescale_kv",
    "check_options",
    "prepare",
    "evaluate",
    "load_model",
    "environment",
    "model_directory",
    "plot_layer_errors",
]
