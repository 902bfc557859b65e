"""Greedy tokens compared with a reference's up to near ties of the reference's logits."""

from __future__ import annotations

import torch


def margins(logits: torch.Tensor) -> torch.Tensor:
    """The gap between the best and the second-best logit of each row of `logits` [tokens, vocab]."""
    top2 = logits.float().topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).cpu()


def assert_equal_up_to_near_ties(expected, generated, near_tie: float) -> int:
    """Each of `generated` (token lists) equals its reference's tokens (`expected`: (tokens, margins)
    pairs, margins the gaps of the reference's logits at each token) up to the first token whose gap is
    within `near_tie`: there a rounding may pick the other token, and the texts part. Returns how many
    equal their reference throughout."""
    whole = 0
    for i, ((tokens, gaps), got) in enumerate(zip(expected, generated, strict=True)):
        assert len(got) == len(tokens), (i, got, tokens)
        differ = [j for j, (a, b) in enumerate(zip(got, tokens)) if a != b]
        assert not differ or gaps[differ[0]] <= near_tie, (i, differ, gaps)
        whole += not differ
    return whole
