"""The code blocks of README.md and docs/guide.md, read from the files at run time.

- Python blocks are executed, each in a namespace of its own, in one process per file, with
  FutureWarning as an error. They run in a directory where `path/to/checkpoint` (the placeholder the
  pages use) is a small real checkpoint: the one docs/guide.md's checkpoint example writes.
- Bash blocks are not executed (they install, build and download for minutes): every command in them
  is checked. `python3 -m fp8kv ...` is parsed by fp8kv's own parser (which checks the values, the
  placeholder checkpoint included); `python3 -m pip install ...` by pip's parser, and a local
  `".[extra]"` must name an extra of fp8kv; `python3 -m venv` flags must be in its help;
  `bash scripts/X.sh JOB` must be a script whose usage names JOB; `. DIR/bin/activate` must follow
  the venv command that makes DIR.
- JSON blocks must parse. `$ python -m fp8kv inspect ...` sample output is compared with what
  inspect prints for the placeholder checkpoint (a line `...` stands for lines left out).
- A block that needs what a CPU test machine does not have is marked on the line before it with
  `<!-- doc-test: skip (REASON) -->`, REASON one of SKIP_REASONS; it is neither run nor checked, and
  only such blocks are.
"""

from __future__ import annotations

import json
import pathlib
import re
import shlex
import subprocess
import sys
from importlib import metadata

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parents[2]
PAGES = ["README.md", "docs/guide.md"]
SKIP_REASONS = {"needs a GPU", "needs the network", "needs vLLM"}
MARKER = re.compile(r"<!-- doc-test: skip \((.*)\) -->")
CHECKPOINT = "path/to/checkpoint"


class Block:
    def __init__(self, page: str, line: int, language: str, text: str, skip: str | None):
        self.page, self.line, self.language, self.text, self.skip = page, line, language, text, skip

    def __repr__(self) -> str:
        return f"{self.page}:{self.line} ({self.language or 'no language'})"


def blocks(page: str) -> list[Block]:
    """The fenced blocks of `page` (indented ones, in lists, included), with the skip marker before each."""
    lines = (REPO / page).read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = re.fullmatch(r"(\s*)```(\S*)\s*", lines[i])
        if not fence:
            i += 1
            continue
        indent, start = fence.group(1), i
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        previous = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.search(previous)
        text = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in lines[start + 1:end])
        found.append(Block(page, start + 1, fence.group(2), text + "\n", marker.group(1) if marker else None))
        i = end + 1
    return found


ALL = [block for page in PAGES for block in blocks(page)]


def test_only_marked_blocks_are_skipped_and_only_for_a_known_reason():
    for page in PAGES:
        markers = [m.group(1) for m in MARKER.finditer((REPO / page).read_text())]
        assert markers == [b.skip for b in ALL if b.page == page and b.skip], f"{page}: a marker not before a block"
        assert set(markers) <= SKIP_REASONS, f"{page}: skip reasons {set(markers) - SKIP_REASONS}"
    languages = {b.language for b in ALL}
    assert languages <= {"python", "bash", "json", "text", ""}, languages
    assert any(b.language == "python" and not b.skip for b in ALL if b.page == "README.md")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> pathlib.Path:
    """A directory holding `path/to/checkpoint`: docs/guide.md's example checkpoint (Llama, 2 layers,
    4 KV heads, per-head K/V scales)."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("docs")
    checkpoint = root / CHECKPOINT
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
        "hidden_size": 512, "head_dim": 64}))
    save_file({f"model.layers.{i}.self_attn.{kv}_scale": torch.tensor([0.01, 0.02, 0.03, 0.04])
               for i in range(2) for kv in "kv"}, str(checkpoint / "model.safetensors"))
    return root


# Each block in a namespace of its own, in one process (one import of torch and transformers).
RUN_BLOCKS = """
import sys, warnings
warnings.simplefilter("error", FutureWarning)
for name, block in zip(*[iter(sys.stdin.read().split("\\0"))] * 2):
    try:
        exec(compile(block, name, "exec"), {"__name__": "__main__"})
    except Exception as e:
        sys.exit(f"{name} failed: {type(e).__name__}: {e}")
"""


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_run(page, workdir):
    pytest.importorskip("transformers")
    runnable = [b for b in ALL if b.page == page and b.language == "python" and not b.skip]
    assert runnable
    child = subprocess.run([sys.executable, "-c", RUN_BLOCKS], cwd=workdir, capture_output=True, text=True,
                           input="\0".join(f"{b!r}\0{b.text}" for b in runnable), timeout=900)
    assert child.returncode == 0, child.stderr[-3000:]
    assert "Warning" not in child.stderr, child.stderr[-3000:]


def commands(block: Block) -> list[list[str]]:
    """The commands of a bash block: continuation lines joined, comments and blank lines dropped."""
    text = block.text.replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in text.splitlines() if shlex.split(line, comments=True)]


def pip_install(argv: list[str]):
    from pip._internal.commands import create_command

    options, requirements = create_command("install").parse_args(argv)  # exits on an unknown option
    extras = metadata.metadata("fp8kv").get_all("Provides-Extra")  # pyproject.toml's, as installed
    for requirement in requirements:
        local = re.fullmatch(r"\.\[(.*)\]", requirement)
        if local:
            assert set(local.group(1).split(",")) <= set(extras), f"{requirement}: extras are {sorted(extras)}"
        else:
            assert requirement != "." or options.no_build_isolation, "fp8kv builds against the installed torch"


def fp8kv_parses(argv: list[str]):
    from fp8kv.cli import _parser

    _parser("fp8kv").parse_args(argv)  # raises SystemExit, with the error on stderr, when it does not parse


def check_command(argv: list[str], venvs: set[str]):
    if argv[:4] == ["python3", "-m", "pip", "install"]:
        pip_install(argv[4:])
    elif argv[:3] == ["python3", "-m", "fp8kv"] or argv[:3] == ["python", "-m", "fp8kv"]:
        fp8kv_parses(argv[3:])
    elif argv[:3] == ["python3", "-m", "venv"]:
        help_text = subprocess.run([sys.executable, "-m", "venv", "--help"], capture_output=True, text=True).stdout
        assert all(flag in help_text for flag in argv[3:] if flag.startswith("-")), argv
        venvs.add(argv[-1])
    elif argv[0] == "bash" and argv[1].startswith("scripts/"):
        script = (REPO / argv[1]).read_text()
        usage = re.search(r"usage: bash \S+ (\S+)", script).group(1).split("|")
        assert argv[2] in usage, f"{argv}: {argv[1]} takes {usage}"
    elif argv[0] == "." and argv[1].endswith("/bin/activate"):
        assert argv[1].removesuffix("/bin/activate") in venvs, f"{argv}: no venv command made it"
    else:
        raise AssertionError(f"no check for the command {argv}: teach this test, or mark the block")


def test_bash_commands_exist_and_parse(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    checked, venvs = 0, set()
    for block in ALL:
        if block.language != "bash" or block.skip:
            continue
        for argv in commands(block):
            try:
                check_command(argv, venvs)
            except SystemExit as e:
                raise AssertionError(f"{block}: {shlex.join(argv)} does not parse (exit {e.code})") from e
            checked += 1
    assert checked >= 10


def test_json_blocks_parse():
    for block in ALL:
        if block.language == "json" and not block.skip:
            json.loads(block.text)


def test_inspect_sample_output_is_what_inspect_prints(workdir):
    samples = [b for b in ALL if b.text.startswith("$ python -m fp8kv inspect ")]
    assert samples
    for block in samples:
        command, *expected = block.text.splitlines()
        argv = shlex.split(command[2:])
        shown = argv[-1]
        argv[-1] = CHECKPOINT
        child = subprocess.run([sys.executable, *argv[1:]], cwd=workdir, capture_output=True, text=True, timeout=300)
        assert child.returncode == 0, child.stderr
        printed = child.stdout.replace(CHECKPOINT, shown).splitlines()
        # A "..." line stands for printed lines left out of the sample.
        pattern = "\n".join(".*?" if line == "..." else re.escape(line) for line in expected)
        assert re.fullmatch(pattern, "\n".join(printed), re.DOTALL), f"{block}:\n{child.stdout}"
