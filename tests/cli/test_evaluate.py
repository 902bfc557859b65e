"""fp8kv.evaluate: metrics against float64 references, the evaluation loop against an independent
re-computation on a tiny random Llama, the unquantized paged cache against transformers' SDPA,
exact K/V rescaling, and argument validation of `python -m fp8kv evaluate`."""

import argparse
import importlib.util
import math
import re

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from checkpoints import truncate  # noqa: E402
from fp8kv import evaluate as ev  # noqa: E402
from fp8kv.calibration import calibrate  # noqa: E402
from fp8kv.commands import evaluate as command  # noqa: E402
from fp8kv.commands.errors import CommandError  # noqa: E402
from fp8kv.formats import KVCacheConfig, KVCacheDtype  # noqa: E402
from fp8kv.integrations.transformers import PagedCache, cache_argument, enable  # noqa: E402
from fp8kv.rotation import Rotation  # noqa: E402

# Tiny models: one CPU thread (conftest.py says why).
pytestmark = pytest.mark.usefixtures("one_cpu_thread")

VOCAB, HIDDEN, HEADS = 64, 256, 4


def tiny_llama(dtype=torch.bfloat16, seed: int = 0, layers: int = 2):
    """A random-weight Llama: 4 query heads and 2 KV heads of 64 (the CUDA kernels' head size), 64 tokens."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=512,
                                      num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=2,
                                      max_position_embeddings=256)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


def windows(count: int = 2, length: int = 40, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (count, length), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- metrics


def float64_scores(logits: np.ndarray, reference: np.ndarray, targets: np.ndarray) -> dict:
    """Perplexities, mean KL(reference || logits) and top-1 agreement, written out in float64."""
    def log_softmax(x):
        shifted = x - x.max(-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))

    log_q, log_p = log_softmax(logits.astype(np.float64)), log_softmax(reference.astype(np.float64))
    rows = np.arange(len(targets))
    return dict(perplexity=math.exp(-log_q[rows, targets].mean()),
                reference_perplexity=math.exp(-log_p[rows, targets].mean()),
                kl=float((np.exp(log_p) * (log_p - log_q)).sum(-1).mean()),
                top1=float((logits.argmax(-1) == reference.argmax(-1)).mean()))


def test_logit_scores_match_float64_reference(monkeypatch):
    # 600 rows in chunks of 64 (the last of each call partial), added in two calls (two windows).
    monkeypatch.setattr(ev.metrics, "_CPU_CHUNK_ELEMENTS", 64 * 11)
    generator = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(600, 11, generator=generator)
    reference = logits + 0.5 * torch.randn(600, 11, generator=generator)
    targets = torch.randint(0, 11, (600,), generator=generator)
    scores = ev.LogitScores()
    scores.add(logits[:250], ev.ReferenceLogits(reference[:250], targets[:250]))
    scores.add(logits[250:], ev.ReferenceLogits(reference[250:], targets[250:]))
    expected = float64_scores(logits.numpy(), reference.numpy(), targets.numpy())
    assert scores.count == 600
    # float64 sums of 600 terms: agreement to ~1e-15 relative; 1e-12 leaves room for summation order.
    assert scores.perplexity == pytest.approx(expected["perplexity"], rel=1e-12)
    assert scores.reference_perplexity == pytest.approx(expected["reference_perplexity"], rel=1e-12)
    assert scores.mean_kl == pytest.approx(expected["kl"], rel=1e-12)
    assert 0 < expected["top1"] < 1 and scores.top1 == expected["top1"]
    # The noise: two standard errors of the mean per-token log-likelihood difference, as a factor.
    rows = np.arange(600)
    difference = (torch.log_softmax(reference.double(), -1) - torch.log_softmax(logits.double(), -1)).numpy()[
        rows, targets.numpy()]
    assert scores.perplexity_noise == pytest.approx(math.expm1(2 * difference.std(ddof=1) / math.sqrt(600)), rel=1e-9)


def test_reference_logits_per_row_match_float64(monkeypatch):
    monkeypatch.setattr(ev.metrics, "_CPU_CHUNK_ELEMENTS", 16 * 50)  # 16 rows a chunk: 3 chunks, one partial
    generator = torch.Generator().manual_seed(2)
    logits = (4 * torch.randn(40, 50, generator=generator)).bfloat16()
    targets = torch.randint(0, 50, (40,), generator=generator)
    reference = ev.ReferenceLogits(logits, targets)
    assert reference.chunks == [slice(0, 16), slice(16, 32), slice(32, 48)]
    z = logits.double().numpy()
    top = z.max(-1, keepdims=True)
    lse = (top + np.log(np.exp(z - top).sum(-1, keepdims=True)))[:, 0]
    assert reference.log_normalizer.dtype == torch.float64
    np.testing.assert_allclose(reference.log_normalizer.numpy(), lse, rtol=1e-14)
    np.testing.assert_allclose(reference.target_log_prob.numpy(), z[np.arange(40), targets.numpy()] - lse,
                               rtol=1e-13, atol=1e-14)
    assert reference.top1.tolist() == z.argmax(-1).tolist()
    with pytest.raises(ValueError, match=r"logits must be \[tokens, vocab\] and targets \[tokens\], got shapes "
                       r"\[40, 50\] and \[39\]"):
        ev.ReferenceLogits(logits, targets[1:])
    with pytest.raises(ValueError, match=r"logits must be shaped as the reference's \[40, 50\], got \[40, 49\]"):
        ev.LogitScores().add(logits[:, 1:], reference)


def test_identical_logits_score_exactly_zero_kl_in_every_chunk(monkeypatch):
    # A cache whose logits equal the model's, bit for bit: KL exactly 0 and the model's perplexity,
    # however the rows are chunked (the per-row values of both come from the same chunks).
    generator = torch.Generator().manual_seed(3)
    logits = (5 * torch.randn(70, 300, generator=generator)).bfloat16()
    targets = torch.randint(0, 300, (70,), generator=generator)
    for rows in (1, 16, 70):
        monkeypatch.setattr(ev.metrics, "_CPU_CHUNK_ELEMENTS", rows * 300)
        scores = ev.LogitScores()
        scores.add(logits.clone(), ev.ReferenceLogits(logits, targets))
        assert scores.mean_kl == 0.0 and scores.top1 == 1.0 and scores.perplexity_noise == 0.0
        assert scores.perplexity == scores.reference_perplexity


def test_logit_chunks_cover_every_row_once():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    chunks = ev.metrics.logit_chunks(100, (1 << 20) // 30, cpu)  # 30 rows a chunk on the CPU
    assert chunks == [slice(0, 30), slice(30, 60), slice(60, 90), slice(90, 120)]
    assert ev.metrics.logit_chunks(3, 1 << 22, cpu) == [slice(0, 1), slice(1, 2), slice(2, 3)]  # a row at least
    assert ev.metrics.logit_chunks(600, 128_256, cuda) == [slice(0, 256), slice(256, 512), slice(512, 768)]


def result_with_noise(noise: float, tokens: int) -> ev.EvaluationResult:
    caches = tuple(ev.CacheResult(name, name, 10.5, 0.01, 0.95, (0.02,), n) for name, n in (("a", 0.001), ("b", noise)))
    return ev.EvaluationResult(10.0, tokens, 2, 128, caches, {"model": "m", "dtype": "bfloat16", "device": "cpu"})


def test_a_small_sample_says_which_changes_are_noise():
    # 254 tokens whose perplexity changes are +-8.6% noise: the caveat says so, and how many tokens
    # resolve 1% (the noise shrinks as 1 / sqrt(tokens): 254 x 8.6^2).
    last = result_with_noise(0.086, 254).table().splitlines()[-1]
    assert last == ("Small sample: 254 predicted tokens tell a perplexity change from zero only beyond about +-8.6% "
                    "(two standard errors of the per-token log-likelihood difference), so smaller changes of either "
                    "sign are noise here, not an effect of the cache. Resolving 1% takes about 18,786 predicted "
                    "tokens.")
    # A sample that resolves 1% needs no caveat.
    assert "Small sample" not in result_with_noise(0.009, 30_000).table()


def test_logit_scores_of_known_distributions():
    # Uniform predictions: perplexity is exactly the vocabulary size. Identical logits: KL 0, top-1 1.
    scores = ev.LogitScores()
    scores.add(torch.zeros(5, 7), ev.ReferenceLogits(torch.zeros(5, 7), torch.arange(5)))
    assert scores.perplexity == pytest.approx(7.0, rel=1e-14) and scores.mean_kl == 0.0 and scores.top1 == 1.0
    logits = torch.tensor([[0.0, math.log(3.0)]], dtype=torch.float64)  # q = (1/4, 3/4); p = (1/2, 1/2)
    scores = ev.LogitScores()
    scores.add(logits, ev.ReferenceLogits(torch.zeros(1, 2), torch.tensor([1])))
    assert scores.perplexity == pytest.approx(4 / 3, rel=1e-14)
    assert scores.mean_kl == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3), rel=1e-14)
    assert scores.top1 == 0.0  # argmax 1 vs argmax 0 (ties take the first index)


def test_layer_errors_match_float64_reference():
    generator = torch.Generator().manual_seed(1)
    outputs = [[torch.randn(3, 5, generator=generator) for _ in range(2)] for _ in range(2)]  # [window][layer]
    references = [[torch.randn(3, 5, generator=generator) for _ in range(2)] for _ in range(2)]
    errors = ev.LayerErrors(2)
    for window in range(2):
        for layer in range(2):
            errors.add(layer, outputs[window][layer].bfloat16(), references[window][layer].bfloat16())
    for layer, got in enumerate(errors.relative()):
        out = np.concatenate([outputs[w][layer].bfloat16().double().numpy().ravel() for w in range(2)])
        ref = np.concatenate([references[w][layer].bfloat16().double().numpy().ravel() for w in range(2)])
        assert got == pytest.approx(np.linalg.norm(out - ref) / np.linalg.norm(ref), rel=1e-13)


def test_token_windows():
    ids = list(range(100))
    assert ev.token_windows(ids, 10, 3, bos=7).tolist() == [[7, *range(0, 9)], [7, *range(9, 18)],
                                                            [7, *range(18, 27)]]
    assert ev.token_windows(ids, 10, 2, bos=None).tolist() == [list(range(10)), list(range(10, 20))]
    assert ev.token_windows(ids, 50, 2, bos=None).shape == (2, 50)  # exactly enough
    with pytest.raises(ValueError, match=r"--data: the text has 100 tokens; 3 windows \(--windows\) of 50 tokens "
                       r"\(--seq-len\) need 147"):
        ev.token_windows(ids, 50, 3, bos=0)


# ----------------------------------------------------------------------------- the evaluation loop


def independent_scores(model, tokens, kv_cache):
    """The evaluation written out again: SDPA logits and attention outputs (own hooks), then the
    paged cache's, scored in float64 with numpy."""
    captured = {}
    layers = [layer.self_attn for layer in model.model.layers]
    handles = [m.register_forward_hook(lambda m, a, out, i=i: captured.__setitem__(i, out[0].double().numpy()))
               for i, m in enumerate(layers)]
    logits, references, outputs, ref_outputs = [], [], [], []
    try:
        with torch.no_grad():
            for window in tokens:
                model.set_attn_implementation("sdpa")
                references.append(model(window[None]).logits[0, :-1].float().numpy())
                ref_outputs.append(dict(captured))
                enable(model)
                cache = PagedCache(kv_cache, max_tokens=len(window))
                logits.append(model(window[None], **cache_argument(model, cache)).logits[0, :-1].float().numpy())
                outputs.append(dict(captured))
    finally:
        for handle in handles:
            handle.remove()
        model.set_attn_implementation("sdpa")
    scores = float64_scores(np.concatenate(logits), np.concatenate(references),
                            np.concatenate([w[1:].numpy() for w in tokens]))
    scores["layer_errors"] = [
        np.sqrt(sum(np.square(o[i] - r[i]).sum() for o, r in zip(outputs, ref_outputs))
                / sum(np.square(r[i]).sum() for r in ref_outputs)) for i in range(len(layers))]
    return scores


def test_evaluate_model_matches_an_independent_computation():
    model, tokens = tiny_llama(), windows()
    configs = ev.kv_cache_configs(model, tokens, ["e4m3", "e5m2"], progress=False)
    result = ev.evaluate_model(model, tokens, configs, progress=False)
    assert [c.name for c in result.caches] == ["auto", "e4m3", "e5m2"]
    assert result.tokens == 2 * 39 and (result.windows, result.seq_len) == (2, 40)
    assert model.config._attn_implementation == "sdpa"  # restored
    for cache in result.caches:
        expected = independent_scores(model, tokens, configs[cache.name])
        # Same bf16 forward passes (deterministic on one CPU thread); float64 metrics differ only in
        # summation order.
        assert result.reference_perplexity == pytest.approx(expected["reference_perplexity"], rel=1e-10)
        assert cache.perplexity == pytest.approx(expected["perplexity"], rel=1e-10)
        assert cache.kl == pytest.approx(expected["kl"], rel=1e-8)
        assert cache.top1 == expected["top1"]
        assert cache.layer_errors == pytest.approx(expected["layer_errors"], rel=1e-10)
    # The FP8 formats lose more than the unquantized cache, e5m2 (2 mantissa bits) more than e4m3 (3).
    auto, e4m3, e5m2 = result.caches
    assert auto.kl < e4m3.kl < e5m2.kl
    assert all(a < b < c for a, b, c in zip(auto.layer_errors, e4m3.layer_errors, e5m2.layer_errors))


def passes_that_stop(monkeypatch, events: list, stop_at: int | None = None, stop=None):
    """Records each cache pass's scores in `events` (as ("pass", its number)); the pass numbered `stop_at`
    calls stop() (default: raises KeyboardInterrupt, as Ctrl-C does) before its scores count."""
    add = ev.LogitScores.add

    def counted(self, *args):
        events.append(("pass", len([e for e in events if e[0] == "pass"])))
        if events[-1][1] == stop_at:
            (stop or (lambda: (_ for _ in ()).throw(KeyboardInterrupt)))()
        add(self, *args)

    monkeypatch.setattr(ev.LogitScores, "add", counted)


def test_each_caches_row_is_reported_as_soon_as_it_is_final(monkeypatch):
    # Window-major order (one reference pass per window, then every cache): a cache's scores are final
    # after its pass of the last window, before the next cache's.
    model, tokens = tiny_llama(), windows(count=2, length=24)
    configs = ev.kv_cache_configs(model, tokens, ["e4m3", "e5m2"], progress=False)
    events = []
    passes_that_stop(monkeypatch, events)
    result = ev.evaluate_model(model, tokens, configs, progress=False,
                               on_row=lambda partial: events.append(("row", partial)))
    assert [e[0] for e in events] == ["pass"] * 3 + ["pass", "row"] * 3
    rows = [e[1] for e in events if e[0] == "row"]
    assert [[c.name for c in partial.caches] for partial in rows] == [["auto"], ["auto", "e4m3"], names := [
        "auto", "e4m3", "e5m2"]] and [c.name for c in result.caches] == names
    assert rows[-1] == result and all(partial.caches == result.caches[:len(partial.caches)] for partial in rows)


def test_an_interrupted_evaluation_keeps_the_windows_it_completed(monkeypatch):
    model, tokens = tiny_llama(), windows(count=2, length=24)
    configs = ev.kv_cache_configs(model, tokens, ["e4m3", "e5m2"], progress=False)
    first_window = ev.evaluate_model(model, tokens[:1], configs, progress=False)
    passes_that_stop(monkeypatch, [], stop_at=4)  # the second window's e4m3 pass
    with pytest.raises(ev.EvaluationInterrupted) as interrupted:
        ev.evaluate_model(model, tokens, configs, progress=False)
    assert (interrupted.value.completed, interrupted.value.windows) == (1, 2)
    assert interrupted.value.result == first_window  # the same passes: the same bits
    assert model.config._attn_implementation == "sdpa"  # restored
    passes_that_stop(monkeypatch, [], stop_at=1)  # the first window's e4m3 pass: nothing done
    with pytest.raises(ev.EvaluationInterrupted) as interrupted:
        ev.evaluate_model(model, tokens, configs, progress=False)
    assert interrupted.value.completed == 0 and interrupted.value.result is None


@pytest.mark.parametrize("dtype, unit_roundoff", [(torch.bfloat16, 2.0**-8), (torch.float16, 2.0**-11)])
@pytest.mark.parametrize("seed", [0, 1])
def test_unquantized_paged_cache_reproduces_sdpa(dtype, unit_roundoff, seed):
    # With o_proj the identity, the first layer's module output is its attention output. Its q/k/v
    # are bit-identical in both runs and both attentions compute in fp32, so they differ by the
    # rounding of the output to the model's dtype: a relative error below one unit roundoff u
    # (measured 0.47u for bf16 and fp16 over 3 seeds). Deeper layers add what earlier layers pass on.
    model = tiny_llama(dtype, seed)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.data = torch.eye(HIDDEN, dtype=dtype)
    tokens = windows(2, 64, seed)
    result = ev.evaluate_model(model, tokens, ev.kv_cache_configs(model, tokens, [], progress=False), progress=False)
    (auto,) = result.caches
    assert auto.layer_errors[0] < unit_roundoff
    assert max(auto.layer_errors) < 2 * unit_roundoff
    # Next-token distributions: KL measured <= 8.7e-7 (bf16) and 1.5e-8 (fp16); 16 x that at most.
    assert auto.kl < 16 * (8.7e-7 if dtype == torch.bfloat16 else 1.5e-8)
    assert abs(auto.perplexity / result.reference_perplexity - 1) < 16 * unit_roundoff


def test_evaluate_model_refuses_empty_input():
    model, configs = tiny_llama(), {"auto": KVCacheConfig.unit_scales("auto", 2)}
    for bad in (torch.zeros(0, 8, dtype=torch.int64), torch.zeros(2, 1, dtype=torch.int64), torch.zeros(8)):
        with pytest.raises(ValueError, match="windows must be"):
            ev.evaluate_model(model, bad, configs, progress=False)
    with pytest.raises(ValueError, match="kv_caches is empty"):
        ev.evaluate_model(model, windows(), {}, progress=False)


def test_any_format_takes_any_scale_source():
    # Calibrated scales are for the e4m3 format named (e5m2 takes e4m3fn's as they are); a checkpoint's
    # are converted as the loader converts them (x2 for e4m3fnuz from e4m3fn scales).
    model, tokens = tiny_llama(), windows()
    amax = calibrate(model, [w[None] for w in tokens], granularity="head", progress=False)
    checkpoint = amax.scales(KVCacheDtype.E4M3FN)
    configs = ev.kv_cache_configs(model, tokens, ["e4m3fnuz-plain-head", "e5m2-plain-tensor", "fp8_e4m3fnuz-plain-checkpoint", "e5m2-plain"],
                                  checkpoint={Rotation.NONE: checkpoint}, progress=False)
    assert configs["e4m3fnuz-plain-head"] == amax.scales(KVCacheDtype.E4M3FNUZ)
    e5m2 = configs["e5m2-plain-tensor"]
    assert e5m2.dtype is KVCacheDtype.E5M2 and e5m2.k_scales == ev.per_tensor(amax).scales().k_scales
    fnuz = configs["fp8_e4m3fnuz-plain-checkpoint"]
    assert fnuz.dtype is KVCacheDtype.E4M3FNUZ
    assert fnuz.k_scales == tuple(tuple(2 * s for s in heads) for heads in checkpoint.k_scales)
    assert configs["e5m2-plain"] == KVCacheConfig.unit_scales(KVCacheDtype.E5M2, 2, rotation="none")


def test_per_tensor_maxima_equal_per_tensor_calibration():
    model, tokens = tiny_llama(), windows()
    batches = [w[None] for w in tokens]
    per_head = calibrate(model, batches, granularity="head", progress=False)
    assert ev.per_tensor(per_head) == calibrate(model, batches, granularity="tensor", progress=False)


# ----------------------------------------------------------------------------- when calibration matters


@pytest.mark.parametrize("k_factor, v_factor", [(2.0**12, 1.0), (1.0, 2.0**-12)])
def test_rescaled_kv_breaks_unit_scales_and_not_calibrated_ones(k_factor, v_factor):
    def sharp_llama():
        # Random weights attend almost uniformly, so K would hardly matter: queries x16 (exact) make
        # the attention as selective as a trained model's.
        model = tiny_llama()
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.data *= 16
        return model

    tokens = windows()
    names = ["e4m3-plain", "e4m3-plain-tensor", "e4m3-plain-head"]
    original = sharp_llama()
    base = ev.evaluate_model(original, tokens, ev.kv_cache_configs(original, tokens, names, progress=False),
                             progress=False)
    model = ev.rescale_kv(sharp_llama(), k_factor, v_factor)
    result = ev.evaluate_model(model, tokens, ev.kv_cache_configs(model, tokens, names, progress=False),
                               progress=False)
    # Powers of two: the model computes bit for bit what it computed before ...
    assert result.reference_perplexity == base.reference_perplexity
    assert result.cache("auto") == base.cache("auto")
    # ... and calibrated scales move by the same power of two, so the FP8 cache holds the same codes.
    for name in ("e4m3-plain-tensor", "e4m3-plain-head"):
        assert result.cache(name) == base.cache(name)
    # Scale 1: K x 4096 saturates at 448, V / 4096 falls below e4m3's smallest subnormal (2^-9).
    unit, calibrated = result.cache("e4m3-plain"), result.cache("e4m3-plain-tensor")
    assert unit.kl > 10 * calibrated.kl
    assert min(unit.layer_errors) > 5 * max(calibrated.layer_errors)


def test_rescale_kv_refuses_inexact_factors():
    model = tiny_llama()
    for bad in (3.0, 0.0, -2.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="k_factor must be a positive power of two"):
            ev.rescale_kv(model, bad, 1.0)
    with pytest.raises(ValueError, match="v_factor must be a positive power of two"):
        ev.rescale_kv(model, 1.0, 0.3)


# ----------------------------------------------------------------------------- the command's arguments


@pytest.fixture
def checkpoint(tmp_path):
    """A tiny Llama checkpoint directory with a word-level tokenizer (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<bos>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 2)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", unk_token="<unk>")
    model = tiny_llama(torch.float32)
    model.save_pretrained(tmp_path / "model")
    fast.save_pretrained(tmp_path / "model")
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{(7 * i) % (VOCAB - 2)}" for i in range(400)) + "\n")
    return tmp_path / "model", text


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fails the test if the model's weights are loaded: bad arguments must be refused before."""
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("the model was loaded before the arguments were checked"))


def run_cli(argv):
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return command.run(parser.parse_args(argv))


@pytest.mark.parametrize("windows, words", [(1, "1 window x 16 tokens"), (2, "2 windows x 16 tokens")])
def test_table_counts_windows_in_words(windows, words):
    cache = ev.CacheResult("e4m3", "e4m3, scale 1", 10.5, 0.01, 0.95, (0.02, 0.03), 0.001)
    result = ev.EvaluationResult(10.0, windows * 15, windows, 16, (cache,), {"model": "m", "dtype": "bfloat16",
                                                                              "device": "cpu"})
    first = result.table().splitlines()[0]
    assert first == f"m: {words} ({windows * 15} predicted), bfloat16 on cpu"
    assert "| e4m3, scale 1 | 10.5000 | +5.00% |" in result.table()


def test_command_prints_table_and_writes_json(checkpoint, tmp_path, capsys):
    import json

    model_dir, text = checkpoint
    out = tmp_path / "result.json"
    assert run_cli(["--model", str(model_dir), "--data", str(text), "--seq-len", "32", "--windows", "3",
                    "--kv-cache-dtype", "e4m3-plain", "e4m3-plain-head", "--device", "cpu", "--json", str(out),
                    "--no-progress"]) == 0
    printed = capsys.readouterr().out
    # Labelled with the model as the user named it, each cache by its canonical name.
    assert f"{model_dir}: 3 windows x 32 tokens (93 predicted), bfloat16 on CPU" in printed
    for label in ("unquantized (model dtype)", "float8_e4m3fn, plain, scale 1", "float8_e4m3fn, plain, calibrated per head"):
        assert f"| {label} |" in printed
    saved = json.loads(out.read_text())
    assert [c["name"] for c in saved["caches"]] == ["auto", "float8_e4m3fn-plain", "float8_e4m3fn-plain-head"]
    assert saved["setup"]["data"] == [str(text)] and len(saved["caches"][0]["layer_errors"]) == 2


def test_command_prints_each_row_before_the_next_caches_pass(checkpoint, monkeypatch, capsys):
    model_dir, text = checkpoint
    wrapped, seen = ev.LogitScores.add, []  # seen: what stdout received before each cache pass

    def add(self, *args):
        seen.append(capsys.readouterr().out)
        wrapped(self, *args)

    monkeypatch.setattr(ev.LogitScores, "add", add)
    assert run_cli(["--model", str(model_dir), "--data", str(text), "--seq-len", "32", "--windows", "2",
                    "--kv-cache-dtype", "e4m3", "e5m2", "--device", "cpu", "--no-progress"]) == 0
    seen.append(capsys.readouterr().out)
    # Passes: window 1 (auto, e4m3, e5m2), window 2 (auto, e4m3, e5m2); nothing printed before the last
    # window's, then the heading and auto's row before e4m3's last pass, e4m3's row before e5m2's.
    assert seen[:4] == [""] * 4
    assert seen[4].splitlines()[-1].startswith("| unquantized (model dtype) |") and seen[4].count("\n") == 6
    assert seen[5].splitlines() == [next(line for line in "".join(seen).splitlines() if "e4m3fn, rotated" in line)]
    assert seen[6].startswith("| float8_e5m2, rotated, scale 1 |")


@pytest.mark.parametrize("stop", ["Ctrl-C", "SIGTERM"])
def test_an_interrupted_command_prints_and_writes_the_windows_it_completed(checkpoint, tmp_path, monkeypatch, capsys,
                                                                           stop):
    import json
    import os
    import signal

    model_dir, text = checkpoint
    out = tmp_path / "result.json"
    argv = ["--model", str(model_dir), "--data", str(text), "--seq-len", "32", "--windows", "3", "--kv-cache-dtype",
            "e4m3", "--device", "cpu", "--json", str(out), "--no-progress"]
    terminate = (lambda: os.kill(os.getpid(), signal.SIGTERM)) if stop == "SIGTERM" else None
    passes_that_stop(monkeypatch, [], stop_at=5, stop=terminate)  # in the third window
    with pytest.raises(CommandError, match="^interrupted after 2 of 3 windows: their scores are above and in "
                       "--json$") as error:
        run_cli(argv)
    assert error.value.status == 130
    printed = capsys.readouterr().out
    assert "\ninterrupted: every cache over the 2 of 3 windows completed\n" in printed
    assert f"{model_dir}: 2 windows x 32 tokens (62 predicted)" in printed
    saved = json.loads(out.read_text())
    assert saved["windows"] == 2 and saved["tokens"] == 62 and saved["setup"]["interrupted"] == "after 2 of 3 windows"
    assert [c["name"] for c in saved["caches"]] == ["auto", "float8_e4m3fn"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored
    passes_that_stop(monkeypatch, [], stop_at=1)
    out.unlink()
    with pytest.raises(CommandError, match="^interrupted before the first window was scored$"):
        run_cli(argv)
    assert not out.exists()


def test_command_plots_layer_errors(checkpoint, tmp_path):
    pytest.importorskip("matplotlib")
    model_dir, text = checkpoint
    png = tmp_path / "layers.png"
    run_cli(["--model", str(model_dir), "--data", str(text), "--seq-len", "16", "--windows", "1",
             "--kv-cache-dtype", "e5m2", "--device", "cpu", "--png", str(png), "--no-progress"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("extra, message", [
    (["--seq-len", "1"], "argument --seq-len: must be an integer >= 2, got 1"),
    (["--seq-len", "300"], r"argument --seq-len: 300 is beyond the model's max_position_embeddings \(256\)"),
    (["--windows", "40"], r"argument --data: the text has 400 tokens; 40 windows \(--windows\) of 16 tokens"),
    (["--kv-cache-dtype", "e4m3-plain-checkpoint"], "argument --kv-cache-dtype: float8_e4m3fn-plain-checkpoint needs that "
     "recipe's KV cache scales .* and .* has none; pass --scales"),
    # argparse refuses these (argument types, choices): a usage error, exit status 2
    (["--windows", "0"], None),
    (["--kv-cache-dtype", "e4m3", "fp9"], None),
    (["--kv-cache-dtype", "e5m2-calibrated"], None),
    (["--device", "meta"], None),
    (["--device", "nonsense"], None),
    (["--dtype", "float32"], None),
])
def test_bad_arguments_are_refused_before_loading_the_model(checkpoint, no_model_loading, extra, message):
    model_dir, text = checkpoint
    argv = ["--model", str(model_dir), "--data", str(text), "--seq-len", "16", "--device", "cpu", *extra]
    if message is None:
        with pytest.raises(SystemExit) as exit_info:
            run_cli(argv)
        assert exit_info.value.code == 2
        return
    with pytest.raises(CommandError, match=message):
        run_cli(argv)


def test_bad_paths_are_refused_with_the_option_named(checkpoint, tmp_path, no_model_loading):
    model_dir, text = checkpoint
    base = ["--model", str(model_dir), "--data", str(text)]
    cases = [
        (["--model", str(tmp_path), "--data", str(text)], "argument --model: .* is not a checkpoint directory"),
        ([*base, "--scales", str(model_dir)], "argument --scales: .* has no KV cache scales"),
        ([*base, "--scales", str(tmp_path / "nowhere")], "argument --scales: .* is not a checkpoint directory"),
    ]
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    cases.append((["--model", str(model_dir), "--data", str(empty)], r"argument --data: text file\(s\) holding no "
                  "text"))
    for argv, message in cases:
        with pytest.raises(CommandError, match=message):
            run_cli(argv)
    # Paths that argparse's argument types refuse: a usage error, exit status 2
    for argv in ([*base, str(tmp_path / "missing.txt")], [*base, "--json", str(tmp_path / "no" / "r.json")],
                 [*base, "--png", str(tmp_path)]):
        with pytest.raises(SystemExit) as exit_info:
            run_cli(argv)
        assert exit_info.value.code == 2


def test_a_checkpoint_missing_weights_is_refused(checkpoint):
    from safetensors.torch import load_file, save_file

    model_dir, text = checkpoint
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CommandError, match=r"^argument --model: .*model: the weights do not fit its config.json: 1 missing "
                                         r"\(model.norm.weight\)$"):
        run_cli(["--model", str(model_dir), "--data", str(text), "--seq-len", "32", "--windows", "1", "--device", "cpu",
                 "--no-progress"])


def test_a_damaged_checkpoint_is_one_line_naming_the_option_and_the_file(checkpoint, tmp_path):
    from fp8kv.calibration import export_checkpoint

    model_dir, text = checkpoint
    kv_cache = calibrate(tiny_llama(), [windows()[0][None]], progress=False).scales()
    args = ["--data", str(text), "--seq-len", "16", "--windows", "1", "--device", "cpu", "--no-progress",
            "--kv-cache-dtype", "e4m3-plain-checkpoint"]
    damaged = export_checkpoint(model_dir, tmp_path / "damaged", kv_cache)
    truncate(damaged / "model.safetensors")
    with pytest.raises(CommandError, match=f"^argument --scales: {re.escape(str(damaged))}/model.safetensors: "
                       "truncated: the file has \\d+ bytes, its header describes \\d+$"):
        run_cli(["--model", str(model_dir), "--scales", str(damaged), *args])
    # The model's own weights, damaged where --scales holds the scales: found as they load.
    scales = export_checkpoint(model_dir, tmp_path / "scales", kv_cache)
    truncate(model_dir / "model.safetensors")
    with pytest.raises(CommandError, match=f"^argument --model: {re.escape(str(model_dir))}/model.safetensors: "
                       "truncated: the file has \\d+ bytes, its header describes \\d+$"):
        run_cli(["--model", str(model_dir), "--scales", str(scales), *args])


def test_png_without_matplotlib_names_the_package(checkpoint, tmp_path, monkeypatch):
    model_dir, text = checkpoint
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    with pytest.raises(CommandError, match="--png needs the Python package 'matplotlib'"):
        run_cli(["--model", str(model_dir), "--data", str(text), "--png", str(tmp_path / "x.png")])


def test_checkpoint_scales_are_used_and_checked(checkpoint, tmp_path):
    from fp8kv.calibration import export_checkpoint

    model_dir, text = checkpoint
    model, tokens = tiny_llama(), windows()
    kv_cache = calibrate(model, [w[None] for w in tokens], granularity="head", progress=False).scales()
    with_scales = export_checkpoint(model_dir, tmp_path / "with_scales", kv_cache)
    plan = ev.prepare(model_dir, text.read_text(), ["e4m3-plain-checkpoint"], seq_len=16, windows=2, scales=with_scales,
                      device="cpu")
    assert plan.checkpoint[Rotation.NONE].k_scales == kv_cache.k_scales and plan.caches == ("float8_e4m3fn-plain-checkpoint",)
    # The model's own scales are found without --scales, and the default caches then include them.
    assert "float8_e4m3fn-plain-checkpoint" in ev.prepare(with_scales, text.read_text(), seq_len=16, windows=2).caches
    assert "float8_e4m3fn-plain-checkpoint" not in ev.prepare(model_dir, text.read_text(), seq_len=16, windows=2).caches
    # Scales of another geometry are refused.
    other = tmp_path / "other"
    bigger = tiny_llama(torch.float32, layers=3)
    bigger.save_pretrained(other)
    three_layers = calibrate(bigger, [tokens[0][None]], progress=False).scales()
    export_checkpoint(other, tmp_path / "other_scales", three_layers)
    with pytest.raises(ValueError, match="--scales: .* has scales for 3 layers x \\[1\\] heads; the model has 2 "
                       "layers and 2 KV heads"):
        ev.prepare(model_dir, text.read_text(), seq_len=16, windows=2, scales=tmp_path / "other_scales")


def test_recipes_get_their_rotation_offsets_and_scales(checkpoint, tmp_path):
    """Plain, rotated and rotated + centred caches from every source: offsets calibrated on the windows
    are the calibration's; the checkpoint's rotated recipe is its fp8kv_kv_cache.json."""
    from fp8kv.calibration import export_checkpoint

    model_dir, text = checkpoint
    model, tokens = tiny_llama(), windows()
    amax = calibrate(model, [w[None] for w in tokens], granularity="head", progress=False)
    rotated = amax.rotated.kv_cache("fp8_e4m3", "head")
    with_scales = export_checkpoint(model_dir, tmp_path / "with_scales", amax.scales(), rotated=rotated)
    plan = ev.prepare(model_dir, text.read_text(), seq_len=16, windows=2, scales=with_scales, device="cpu")
    # Every default cache but the rotated recipe without offsets: the checkpoint's has them.
    assert plan.caches == tuple(ev.cache_name(n) for n in ev.CACHES if n != "e4m3-checkpoint")
    names = ["e4m3-rotated-tensor", "e4m3-centred-head", "e5m2-rotated-checkpoint"]
    with pytest.raises(ValueError, match="float8_e5m2-checkpoint needs that recipe's KV cache scales"):
        ev.prepare(model_dir, text.read_text(), names, seq_len=16, windows=2, scales=with_scales, device="cpu")
    configs = ev.kv_cache_configs(model, tokens, plan.caches + tuple(map(ev.cache_name, names[:2])),
                                  checkpoint=plan.checkpoint, progress=False)
    recipes = {name: (config.dtype.value, config.recipe) for name, config in configs.items()}
    e4m3, e5m2 = "float8_e4m3fn", "float8_e5m2"
    assert recipes == {
        "auto": ("auto", "plain"), f"{e4m3}-plain": (e4m3, "plain"), f"{e4m3}-plain-checkpoint": (e4m3, "plain"),
        f"{e4m3}-plain-tensor": (e4m3, "plain"), f"{e4m3}-plain-head": (e4m3, "plain"), e4m3: (e4m3, "rotated"),
        f"{e4m3}-centred": (e4m3, "rotated + centred"), f"{e4m3}-centred-checkpoint": (e4m3, "rotated + centred"),
        f"{e5m2}-plain": (e5m2, "plain"), e5m2: (e5m2, "rotated"), f"{e5m2}-centred": (e5m2, "rotated + centred"),
        f"{e4m3}-tensor": (e4m3, "rotated"), f"{e4m3}-centred-head": (e4m3, "rotated + centred")}
    offsets = amax.rotated.k_offsets
    assert configs[f"{e4m3}-centred"].k_offsets == offsets == configs[f"{e5m2}-centred"].k_offsets
    assert configs[f"{e4m3}-centred"].k_scales == configs[e4m3].k_scales == ((1.0,),) * 2
    from_checkpoint = configs[f"{e4m3}-centred-checkpoint"]
    assert (from_checkpoint.k_scales, from_checkpoint.k_offsets) == (rotated.k_scales, rotated.k_offsets)
    calibrated = configs[f"{e4m3}-centred-head"]
    assert (calibrated.k_scales, calibrated.k_offsets) == (rotated.k_scales, offsets)
    assert configs[f"{e4m3}-tensor"].k_scales == amax.rotated.kv_cache("fp8_e4m3", "tensor",
                                                                                centred=False).k_scales
    assert ev.label(f"{e4m3}-centred-checkpoint") == "float8_e4m3fn, rotated + centred, checkpoint scales"


def test_evaluation_text_concatenates_like_cat_and_names_missing_files(tmp_path):
    from fp8kv.models import evaluation_text

    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("one\ntwo\n")
    second.write_text("three")
    assert evaluation_text([first, second]) == "one\ntwo\nthree"
    with pytest.raises(FileNotFoundError, match=r"not found: .*missing1.*, .*missing2"):
        evaluation_text([first, tmp_path / "missing1", tmp_path / "missing2"])
    with pytest.raises(ValueError, match="no text files given"):
        evaluation_text([])


def test_options_are_checked_before_the_packaged_model_is_converted(checkpoint, tmp_path, monkeypatch):
    from fp8kv import models

    _, text = checkpoint
    monkeypatch.chdir(tmp_path)  # no directory named like the packaged model here
    monkeypatch.setattr(models, "smollm2_checkpoint", lambda *a: pytest.fail("converted before the checks"))
    for extra, message in ((["--seq-len", "1"], "--seq-len"), (["--scales", str(tmp_path)], "--scales")):
        with pytest.raises(CommandError, match=message):
            run_cli(["--model", models.SMOLLM2_NAME, "--data", str(text), *extra])
    for extra in (["--kv-cache-dtype", "fp9"], ["--device", "meta"]):  # refused by argparse
        with pytest.raises(SystemExit):
            run_cli(["--model", models.SMOLLM2_NAME, "--data", str(text), *extra])


# ----------------------------------------------------------------------------- FP8 math rows

SM90A = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("name, canonical, text", [
    ("e4m3-centred-checkpoint-fp8math", "float8_e4m3fn-centred-checkpoint-fp8math",
     "float8_e4m3fn, rotated + centred, checkpoint scales, FP8 math"),
    ("fp8_e5m2-plain-fp8math", "float8_e5m2-plain-fp8math", "float8_e5m2, plain, scale 1, FP8 math")])
def test_fp8_math_caches_are_named_and_labelled(name, canonical, text):
    assert ev.cache_name(name) == canonical and ev.label(canonical) == text


@pytest.mark.parametrize("name, message", [
    ("e4m3fnuz-fp8math", r"FP8 math \(fp8math\) reads float8_e4m3fn and float8_e5m2 caches, not float8_e4m3fnuz"),
    ("e4m3-fp8math-head", r"expected FORMAT\[-RECIPE\]\[-SOURCE\]\[-fp8math\]")])
def test_bad_fp8_math_caches_are_refused(name, message):
    with pytest.raises(ValueError, match=message):
        ev.cache_name(name)


def test_fp8_math_rows_follow_each_cache_that_has_them():
    from fp8kv.evaluate.pipeline import with_fp8_math

    assert with_fp8_math(("float8_e4m3fn-head", "float8_e4m3fnuz", "float8_e5m2-centred", "float8_e5m2-fp8math")) == (
        "float8_e4m3fn-head", "float8_e4m3fn-head-fp8math", "float8_e4m3fnuz", "float8_e5m2-centred",
        "float8_e5m2-centred-fp8math", "float8_e5m2-fp8math")


@pytest.mark.parametrize("argv", [["--kv-cache-dtype", "e4m3-fp8math"], ["--kv-cache-dtype", "e4m3", "--fp8-math"]])
def test_fp8_math_off_a_compute_capability_9_gpu_is_refused_before_the_model_loads(checkpoint, no_model_loading, argv):
    model_dir, text = checkpoint
    with pytest.raises(CommandError, match="--kv-cache-dtype float8_e4m3fn-fp8math: FP8 math runs on compute "
                                           "capability 9.0 GPUs, not on cpu"):
        run_cli(["--model", str(model_dir), "--data", str(text), "--seq-len", "32", "--windows", "1", "--device",
                 "cpu", "--no-progress", *argv])


@pytest.mark.gpu
@pytest.mark.skipif(not SM90A, reason="FP8 math runs on compute capability 9.0 GPUs")
def test_fp8_math_rows_next_to_the_16_bit_ones(checkpoint, capsys):
    """The 16-bit and FP8-math rows of each cache: the same cache, so near each other, not identical."""
    import json

    model_dir, text = checkpoint
    assert run_cli(["--model", str(model_dir), "--data", str(text), "--seq-len", "128", "--windows", "2",
                    "--kv-cache-dtype", "e4m3-head", "e5m2-rotated", "--fp8-math", "--device", "cuda",
                    "--no-progress", "--json", str(model_dir.parent / "fp8.json")]) == 0
    caches = {c["name"]: c for c in json.loads((model_dir.parent / "fp8.json").read_text())["caches"]}
    # e5m2-rotated is the bare format's recipe, named without it.
    assert list(caches) == ["auto", "float8_e4m3fn-head", "float8_e4m3fn-head-fp8math", "float8_e5m2",
                            "float8_e5m2-fp8math"]
    for name in ("float8_e4m3fn-head", "float8_e5m2"):
        sixteen, fp8 = caches[name], caches[f"{name}-fp8math"]
        assert fp8["layer_errors"] != sixteen["layer_errors"] and fp8["kl"] < 10 * sixteen["kl"] + 1e-3
    assert "FP8 math |" in capsys.readouterr().out
