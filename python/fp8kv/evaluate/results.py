"""The scores of an evaluation: one `CacheResult` per KV cache, and the `EvaluationResult` table."""

from __future__ import annotations

import dataclasses
import math

# A sample is small when it cannot resolve a perplexity change of 1%: the size of the differences
# between FP8 formats and scale choices on a trained model (docs/accuracy.md).
RESOLVED_CHANGE = 0.01


@dataclasses.dataclass(frozen=True)
class CacheResult:
    """One KV cache's scores against the model's own attention."""

    name: str
    label: str
    perplexity: float
    kl: float  # mean KL(model || cache) per predicted token, in nats
    top1: float  # fraction of predicted tokens whose most likely next token is the model's
    layer_errors: tuple[float, ...]  # relative Frobenius error of each layer's attention output
    perplexity_noise: float  # the smallest relative perplexity change the sample resolves (LogitScores)


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
        return "\n".join(self.table_lines() + self._small_sample_caveat())

    def table_lines(self) -> list[str]:
        """The table's lines before its closing caveat: what was measured, the heading, a row per cache (so a
        result of more caches extends a smaller one's lines)."""
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
        return lines

    def _small_sample_caveat(self) -> list[str]:
        """A line saying which perplexity changes are noise, when the sample cannot resolve RESOLVED_CHANGE."""
        noise = max(c.perplexity_noise for c in self.caches)
        if noise <= RESOLVED_CHANGE:
            return []
        needed = math.ceil(self.tokens * (noise / RESOLVED_CHANGE) ** 2)
        return [f"Small sample: {self.tokens} predicted tokens tell a perplexity change from zero only beyond "
                f"about +-{noise:.1%} (two standard errors of the per-token log-likelihood difference), so smaller "
                f"changes of either sign are noise here, not an effect of the cache. Resolving {RESOLVED_CHANGE:.0%} "
                f"takes about {needed:,} predicted tokens."]
