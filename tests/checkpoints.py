"""Builders of synthetic checkpoint directories for the scale-loading tests, and a runner of
calls that could hang or exhaust memory on a hostile checkpoint.

A checkpoint is config.json plus safetensors files (one file, or shards with an index) holding a
few small weights and the scale tensors under test, and optionally hf_quant_config.json and a
legacy kv_cache_scales.json.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pathlib
import re
import resource
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8kv.calibration import KVAmax
from fp8kv.checkpoint import CheckpointError

ATTENTION = "model.layers.{}.self_attn"


def llama_config(num_layers: int = 2, num_kv_heads: int = 4, **extra) -> dict:
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_attention_heads": 8,
        "num_key_value_heads": num_kv_heads,
        "num_hidden_layers": num_layers,
    }
    config.update(extra)
    return config


def weights(num_layers: int) -> dict[str, torch.Tensor]:
    """Ordinary (non-scale) tensors, so the scales sit among real-looking weights."""
    generator = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(16, 8, generator=generator)}
    for layer in range(num_layers):
        for proj in ("q_proj", "k_proj", "v_proj"):
            tensors[f"{ATTENTION.format(layer)}.{proj}.weight"] = torch.randn(8, 8, generator=generator)
    return tensors


def scale_tensor(values, shape: str = "auto", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A scale tensor holding `values` (a float or a list per head) in one of the stored shapes:
    'scalar' [], 'one' [1], 'heads' [H], 'heads11' [H, 1, 1]; 'auto' is [] or [H]."""
    t = torch.tensor(values, dtype=torch.float64).to(dtype)
    if shape == "auto":
        return t
    return {"scalar": lambda: t.reshape(()), "one": lambda: t.reshape(1), "heads": lambda: t.reshape(-1),
            "heads11": lambda: t.reshape(-1, 1, 1)}[shape]()


def scale_tensors(k, v, *, form: str = "k_scale", shape: str = "auto", dtype=torch.float32,
                  layers=None) -> dict[str, torch.Tensor]:
    """Per-layer scale tensors named as `form` writes them: 'k_scale' (vLLM / llm-compressor),
    'modelopt' (k_proj.k_scale), 'kv_scale' (legacy: k only). k[i], v[i]: layer i's values."""
    tensors = {}
    for layer in (range(len(k)) if layers is None else layers):
        p = ATTENTION.format(layer)
        if form == "k_scale":
            tensors[f"{p}.k_scale"] = scale_tensor(k[layer], shape, dtype)
            tensors[f"{p}.v_scale"] = scale_tensor(v[layer], shape, dtype)
        elif form == "modelopt":
            tensors[f"{p}.k_proj.k_scale"] = scale_tensor(k[layer], shape, dtype)
            tensors[f"{p}.v_proj.v_scale"] = scale_tensor(v[layer], shape, dtype)
        elif form == "kv_scale":
            tensors[f"{p}.kv_scale"] = scale_tensor(k[layer], shape, dtype)
        else:
            raise ValueError(form)
    return tensors


def edit_index(directory, **weight_map_changes) -> None:
    """Sets weight_map entries of the checkpoint's model.safetensors.index.json."""
    path = pathlib.Path(directory) / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    index["weight_map"].update(weight_map_changes)
    path.write_text(json.dumps(index))


def raw_safetensors(path, header: bytes, data: bytes = b"", header_length: int | None = None) -> None:
    """A safetensors file written byte by byte: 8-byte little-endian header length, header, data."""
    length = len(header) if header_length is None else header_length
    pathlib.Path(path).write_bytes(struct.pack("<Q", length) + header + data)


def edit_safetensors_header(path, edit) -> None:
    """Rewrites the JSON header of safetensors file `path` as edit(header dict) leaves it, the tensor
    data unchanged (a header that no longer describes its data, as a corrupted file's would)."""
    raw = pathlib.Path(path).read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    edit(header)
    raw_safetensors(path, json.dumps(header).encode(), raw[8 + length:])


def truncate(path, keep: float = 0.5) -> None:
    """Cuts file `path` to the fraction `keep` of its bytes, as an interrupted copy or download leaves it."""
    path = pathlib.Path(path)
    os.truncate(path, int(path.stat().st_size * keep))


def assert_reported(problems, message: str, file=None, tensor=None) -> None:
    """One of `problems` (Problem objects or their text) names `file` and `tensor` and matches the
    regular expression `message`."""
    lines = [str(p) for p in problems]
    assert any(re.search(message, line) and (file is None or str(file) in line)
               and (tensor is None or tensor in line) for line in lines), (message, file, tensor, lines)


def write_checkpoint(directory, *, config: dict | None = None, tensors: dict | None = None, shards: int = 1,
                     index: bool | None = None, legacy_json: dict | None = None, hf_quant_config: dict | None = None,
                     num_layers: int = 2, num_kv_heads: int = 4) -> pathlib.Path:
    """Writes a checkpoint into `directory` and returns its path.

    tensors: the scale tensors (plus ordinary weights added here). shards > 1 spreads all tensors
    round-robin over that many files; index (default: shards > 1) writes model.safetensors.index.json.
    """
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = llama_config(num_layers, num_kv_heads) if config is None else config
    (directory / "config.json").write_text(json.dumps(config))
    everything = {**weights(num_layers), **(tensors or {})}
    names = sorted(everything)
    if shards == 1:
        files = {"model.safetensors": names}
    else:
        files = {f"model-{i + 1:05d}-of-{shards:05d}.safetensors": names[i::shards] for i in range(shards)}
    for file, file_names in files.items():
        save_file({n: everything[n].contiguous() for n in file_names}, str(directory / file))
    if index if index is not None else shards > 1:
        weight_map = {n: file for file, file_names in files.items() for n in file_names}
        (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if legacy_json is not None:
        (directory / "kv_cache_scales.json").write_text(json.dumps(legacy_json))
    if hf_quant_config is not None:
        (directory / "hf_quant_config.json").write_text(json.dumps(hf_quant_config))
    return directory


def source_checkpoint(directory, *, layout: str, num_layers: int = 2, num_kv_heads: int = 4, config=None):
    """A checkpoint without scales for an export to write into: 'single' (one file, with metadata the
    export must keep) or 'sharded' (three shards and an index)."""
    shards = {"single": 1, "sharded": 3}[layout]
    directory = write_checkpoint(directory, shards=shards, num_layers=num_layers, num_kv_heads=num_kv_heads,
                                 config=config)
    if layout == "single":  # metadata the export must keep
        tensors = load_file(str(directory / "model.safetensors"))
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt", "note": "source"})
    return directory


def random_amax(num_layers: int, width: int, seed: int = 0) -> KVAmax:
    """float32 maxima spanning 1e-3 .. 1e3 (log-uniform)."""
    generator = torch.Generator().manual_seed(seed)
    k, v = (10.0 ** (torch.rand(2, num_layers, width, generator=generator) * 6 - 3)).float().tolist()
    return KVAmax(tuple(map(tuple, k)), tuple(map(tuple, v)), num_tokens=10)


def legacy_json(scaling_factor: dict, dtype: str = "float8_e4m3fn", model_type: str | None = "llama") -> dict:
    """{"model_type", "kv_cache": {"dtype", "scaling_factor": {rank: {layer: s}}}} with string keys."""
    data = {"kv_cache": {"dtype": dtype, "scaling_factor": {
        str(rank): {str(layer): s for layer, s in layers.items()} for rank, layers in scaling_factor.items()}}}
    if model_type is not None:
        data["model_type"] = model_type
    return data


def compressed_tensors_config(strategy: str = "tensor", **scheme_overrides) -> dict:
    scheme = {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True}
    scheme.update(scheme_overrides)
    return {"quant_method": "compressed-tensors", "kv_cache_scheme": scheme}


# A child loads a toy checkpoint in well under a second; the limit leaves room for a loaded machine.
CHILD_TIMEOUT_S = 60
CHILD_EXTRA_MEMORY = 1 << 30  # an unbounded read fails fast instead of filling the machine's memory


def run_in_child(function, *args, **kwargs):
    """function(*args, **kwargs) in a forked child: ('returned', its result) or (exception type name,
    [problem texts] for a CheckpointError else [message]). Fails the test if the child does not
    answer within CHILD_TIMEOUT_S."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)

    def child():
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (mapped + CHILD_EXTRA_MEMORY,) * 2)
        try:
            sender.send(("returned", function(*args, **kwargs)))
        except CheckpointError as e:
            sender.send(("CheckpointError", [str(p) for p in e.problems]))
        except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the test
            sender.send((type(e).__name__, [str(e)]))

    process = context.Process(target=child, daemon=True)
    process.start()
    try:
        if not receiver.poll(CHILD_TIMEOUT_S):
            pytest.fail(f"{function.__name__}{args} did not finish within {CHILD_TIMEOUT_S} s")
        return receiver.recv()
    finally:
        process.kill()
        process.join()


def assert_child_error(outcome, message, file=None, tensor=None):
    kind, problems = outcome
    assert kind == "CheckpointError", outcome
    assert_reported(problems, message, file, tensor)


def smollm2_or_skip() -> pathlib.Path:
    """SmolLM2's converted checkpoint (fp8kv.models), or the test skips, saying what is missing."""
    from fp8kv import models

    try:
        return models.smollm2_checkpoint()
    except models.MissingDependencyError as e:
        pytest.skip(str(e))
