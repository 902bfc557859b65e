"""The metrics of an evaluation and the loop that measures them: perplexity, KL(model || cache)
and top-1 agreement of the next-token distributions, and each layer's relative error of the
attention output, for every KV cache against the model's own attention."""

from __future__ import annotations

import math

import torch

from ..formats import KVCacheConfig
from .caches import fp8_math, label
from .results import CacheResult, EvaluationResult

# Rows of logits turned into float64 at a time. On a CPU, a chunk's float64 copies stay within the
# processor's caches (as many rows as about 8 MiB of them), so the several passes over a chunk read
# the cache rather than memory, and no allocation is large enough to be handed back to the system
# and faulted in again each time; on a GPU, 256 rows bound the float64 temporaries' memory.
_CPU_CHUNK_ELEMENTS = 1 << 20
_GPU_CHUNK_ROWS = 256


def logit_chunks(rows: int, vocab: int, device: torch.device) -> list[slice]:
    """The row slices of [rows, vocab] logits that the scores take one at a time."""
    step = max(1, _CPU_CHUNK_ELEMENTS // vocab) if device.type == "cpu" else _GPU_CHUNK_ROWS
    return [slice(start, start + step) for start in range(0, rows, step)]


class ReferenceLogits:
    """The model's own logits [tokens, vocab] over one window and the `targets` [tokens] they predict,
    with what every cache's scores need of them per row computed once per window rather than once
    per cache: the log-normalizer logsumexp(z), the most likely token and the target's
    log-probability, in float64, chunk by chunk (logit_chunks)."""

    def __init__(self, logits: torch.Tensor, targets: torch.Tensor):
        if logits.dim() != 2 or targets.shape != logits.shape[:1]:
            raise ValueError(f"logits must be [tokens, vocab] and targets [tokens], got shapes {list(logits.shape)} "
                             f"and {list(targets.shape)}")
        self.logits, self.targets = logits, targets
        self.chunks = logit_chunks(*logits.shape, logits.device)
        log_normalizer, top1, target_log_prob = [], [], []
        for rows in self.chunks:
            z = logits[rows].double()
            log_normalizer.append(z.logsumexp(-1))
            top1.append(z.argmax(-1))
            target_log_prob.append(z.gather(1, targets[rows, None])[:, 0] - log_normalizer[-1])
        self.log_normalizer, self.top1, self.target_log_prob = map(torch.cat, (log_normalizer, top1, target_log_prob))


class LogitScores:
    """Running sums over predicted tokens, in float64 on the logits' device (no host sync per window).

    add(logits, reference): the cache's logits [tokens, vocab] against the model's own (ReferenceLogits).
    """

    def __init__(self):
        self.nll = self.reference_nll = self.kl = self.agree = 0.0
        self.squared_difference = 0.0  # of each token's log-likelihood, the model's minus the cache's
        self.count = 0

    def add(self, logits: torch.Tensor, reference: ReferenceLogits) -> None:
        if logits.shape != reference.logits.shape:
            raise ValueError(f"logits must be shaped as the reference's {list(reference.logits.shape)}, got "
                             f"{list(logits.shape)}")
        for rows in reference.chunks:
            z_q, z_p = logits[rows].double(), reference.logits[rows]  # z_p promotes to float64 in each use
            lse_q, lse_p = z_q.logsumexp(-1), reference.log_normalizer[rows]
            q_target = z_q.gather(1, reference.targets[rows, None])[:, 0] - lse_q
            p_target = reference.target_log_prob[rows]
            p = (z_p - lse_p[:, None]).exp_()
            # KL(p || q) = sum p (log p - log q) = sum p (z_p - z_q) - (lse_p - lse_q): the logits'
            # difference first, so identical logits give exactly 0.
            kl = p.mul_(z_p - z_q).sum(-1) - (lse_p - lse_q)
            self.nll = self.nll - q_target.sum()
            self.reference_nll = self.reference_nll - p_target.sum()
            self.squared_difference = self.squared_difference + (p_target - q_target).square().sum()
            self.kl = self.kl + kl.sum()
            self.agree = self.agree + (z_q.argmax(-1) == reference.top1[rows]).sum()
        self.count += reference.targets.numel()

    @property
    def perplexity(self) -> float:
        return math.exp(float(self.nll) / self.count)

    @property
    def reference_perplexity(self) -> float:
        return math.exp(float(self.reference_nll) / self.count)

    @property
    def perplexity_noise(self) -> float:
        """The relative perplexity change this sample cannot tell from zero: two standard errors of the
        mean per-token log-likelihood difference, as a factor exp(2 se) - 1. Tokens are taken as
        independent, so the true noise is, if anything, larger."""
        mean = (float(self.nll) - float(self.reference_nll)) / self.count
        n = self.count
        variance = max(float(self.squared_difference) / n - mean * mean, 0.0) * n / max(n - 1, 1)
        return math.expm1(2 * math.sqrt(variance / n))

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


class EvaluationInterrupted(KeyboardInterrupt):
    """evaluate_model interrupted (Ctrl-C): `result` scores every cache over the `completed` windows
    done before it (None when none was), of the `windows` asked for."""

    def __init__(self, result: EvaluationResult | None, completed: int, windows: int):
        super().__init__(f"interrupted after {completed} of {windows} windows")
        self.result, self.completed, self.windows = result, completed, windows


def evaluate_model(model, windows: torch.Tensor, kv_caches: dict[str, KVCacheConfig], *, setup: dict | None = None,
                   progress: bool = True, on_row=None) -> EvaluationResult:
    """Scores each cache of `kv_caches` (name -> config, labelled by caches.label) against the
    model's own SDPA attention, teacher-forced on `windows` ([count, seq_len] token ids).

    model: a transformers causal LM in float16 or bfloat16, on the device to evaluate on.
    on_row(result): called as each cache's scores become final (in the last window, after its pass),
        with the result of the caches final so far. Each window runs the model's own attention once
        and then every cache, so no window's reference is kept or computed twice.
    Interrupted, it raises EvaluationInterrupted with the scores over the windows completed.
    """
    from tqdm import tqdm

    from ..integrations.transformers import PagedCache, cache_argument, enable

    if windows.dim() != 2 or windows.shape[0] < 1 or windows.shape[1] < 2:
        raise ValueError(f"windows must be [count >= 1, seq_len >= 2] token ids, got shape {list(windows.shape)}")
    if not kv_caches:
        raise ValueError("kv_caches is empty: nothing to evaluate")
    modules = attention_modules(model)
    device = next(model.parameters()).device
    logit_scores = {name: LogitScores() for name in kv_caches}
    layer_errors = {name: LayerErrors(len(modules)) for name in kv_caches}
    setup = {"device": str(device), "dtype": str(model.dtype).removeprefix("torch."), **(setup or {})}

    def result(names, completed: int) -> EvaluationResult:
        caches = tuple(CacheResult(name, label(name), logit_scores[name].perplexity, logit_scores[name].mean_kl,
                                   logit_scores[name].top1, layer_errors[name].relative(),
                                   logit_scores[name].perplexity_noise) for name in names)
        first = logit_scores[names[0]]
        return EvaluationResult(first.reference_perplexity, first.count, completed, windows.shape[1], caches, setup)

    names = list(kv_caches)
    implementation, was_training = model.config._attn_implementation, model.training
    bar = tqdm(total=len(windows) * (1 + len(kv_caches)), unit="pass", desc="evaluating", disable=not progress)
    model.eval()
    completed, done = 0, None  # windows scored, and every cache's result over them
    try:
        with torch.no_grad(), AttentionOutputs(modules) as outputs:
            for window in windows:
                last = completed + 1 == len(windows)
                ids = window[None].to(device)
                targets = ids[0, 1:]
                outputs.record()
                model.set_attn_implementation("sdpa")
                reference = ReferenceLogits(model(input_ids=ids, use_cache=True).logits[0, :-1], targets)
                bar.update()
                enable(model)
                for position, (name, kv_cache) in enumerate(kv_caches.items()):
                    outputs.compare(layer_errors[name])
                    cache = PagedCache(kv_cache, max_tokens=ids.shape[1], fp8_math=fp8_math(name))
                    logits = model(input_ids=ids, **cache_argument(model, cache)).logits[0, :-1]
                    logit_scores[name].add(logits, reference)
                    bar.update()
                    if last and on_row is not None:
                        on_row(result(names[:position + 1], len(windows)))
                completed += 1
                done = result(names, completed)
    except KeyboardInterrupt:
        raise EvaluationInterrupted(done, completed, len(windows)) from None
    finally:
        bar.close()
        model.set_attn_implementation(implementation)
        model.train(was_training)
    return done
