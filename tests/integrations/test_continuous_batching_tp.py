"""Tensor-parallel continuous batching on fp8kv's pages: a model loaded with tp_plan="auto" under
`torchrun --nproc-per-node 2` (gloo on CPU, NCCL on two GPUs) generates the tokens of one process
(generate_batch, and PagedCache + generate), by scripts/check_tp_continuous_batching.py; and the
rule by which enable_continuous_batching gives each rank its KVCacheConfig.

Tensor parallelism sums the output projections' partial products across ranks, which rounds
otherwise than one process: the logits differ by a rounding, which flips a near tie of two tokens
(in bf16 this tiny random model's logits tie to within 0.02 a few times in 48 tokens, and the tokens
then differ). So the model has one layer, whose pages hold the bits one process writes, and runs in
float16, whose finer rounding keeps tensor parallelism's log-probabilities within 0.004 of one
process's, under the smallest gap between the two best tokens (0.016): the tokens must agree
exactly. The checkpoint's second KV head has scales 4x its first's: a rank given the other head's
scales saturates or loses precision, which changes the text.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
from fp8kv.integrations import transformers_continuous_batching as continuous_batching  # noqa: E402

try:
    continuous_batching.check_transformers()
except continuous_batching.UnsupportedTransformersError as e:
    pytest.skip(str(e), allow_module_level=True)

from safetensors.torch import save_file  # noqa: E402
from test_continuous_batching import kv_cache, tiny_model  # noqa: E402

from checkpoints import scale_tensors  # noqa: E402
from fp8kv import load_kv_cache_config  # noqa: E402
from fp8kv.checkpoint.rotated_recipe import RECIPE_FILE, RotatedRecipe  # noqa: E402
from fp8kv.formats import KVCacheConfig  # noqa: E402
from fp8kv.integrations.transformers import enable_continuous_batching  # noqa: E402

SCRIPT = pathlib.Path(__file__).parents[2] / "scripts" / "check_tp_continuous_batching.py"
pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def spread(scales) -> list[tuple[float, ...]]:
    """Each layer's per-head scales with the second head's 4x (a power of two: exact)."""
    return [(layer[0], 4 * layer[1]) for layer in scales]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> pathlib.Path:
    """A 1-layer tiny Llama (2 KV heads) with per-head scales for the plain recipe (scale tensors) and
    the rotated + centred one (fp8kv_kv_cache.json, K offsets included)."""
    directory = tmp_path_factory.mktemp("tp_checkpoint")
    model = tiny_model(num_layers=1).to(torch.float16)
    model.save_pretrained(directory)
    plain, centred = kv_cache(model, "e4m3-plain-head"), kv_cache(model, "e4m3-centred-head")
    save_file(scale_tensors(spread(plain.k_scales), spread(plain.v_scales)), str(directory / "kv_scales.safetensors"))
    recipe = RotatedRecipe(plain.dtype, 64, 2, spread(centred.k_scales), spread(centred.v_scales), centred.k_offsets)
    (directory / RECIPE_FILE).write_text(json.dumps(recipe.to_json()))
    return directory


def torchrun(checkpoint: pathlib.Path, *arguments: str, cuda: bool) -> list[dict]:
    """Each rank's report of scripts/check_tp_continuous_batching.py under 2 processes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the ranks on the CPU, with gloo, on a machine with GPUs too
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
               str(checkpoint), "--dtype", "float16", *arguments]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    reports = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    refused = [report["refused"] for report in reports if "refused" in report]
    if refused and not cuda:
        pytest.skip(f"transformers refuses tensor parallelism on CPU: {refused[0]}")
    assert len(reports) == 2 and not refused, run.stdout + run.stderr[-5000:]
    return sorted(reports, key=lambda report: report["rank"])


def assert_same_tokens(reports: list[dict], recipe: str, device: str) -> None:
    assert [report["rank"] for report in reports] == [0, 1]
    for report in reports:
        assert (report["recipe"], report["device"].split(":")[0]) == (recipe, device)
        assert report["tensor_parallel"] == report["one_process"], report
        assert report["one_process"] == report["paged_cache"], report


@pytest.mark.parametrize("rotation, recipe", [("none", "plain"), ("hadamard", "rotated + centred")])
def test_two_gloo_ranks_generate_the_tokens_of_one_process(checkpoint, rotation, recipe):
    assert_same_tokens(torchrun(checkpoint, "--rotation", rotation, cuda=False), recipe, "cpu")


def test_each_rank_may_be_given_its_own_config(checkpoint):
    reports = torchrun(checkpoint, "--rank-config", cuda=False)
    assert_same_tokens(reports, "rotated + centred", "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("rotation, recipe", [("none", "plain"), ("hadamard", "rotated + centred")])
def test_two_nccl_ranks_generate_the_tokens_of_one_process(checkpoint, rotation, recipe):
    assert_same_tokens(torchrun(checkpoint, "--rotation", rotation, cuda=True), recipe, "cuda")


# ----------------------------------------------------------------------------- each rank's KVCacheConfig


@pytest.mark.parametrize("rotation", ["none", "hadamard"])
def test_a_whole_models_config_is_sliced_as_the_checkpoint_loader_slices_it(checkpoint, rotation, monkeypatch):
    continuous_batching.install_hooks()
    model = tiny_model(num_layers=1)
    whole = load_kv_cache_config(checkpoint, "e4m3", rotation=rotation)
    assert continuous_batching.tensor_parallel_rank(model) == (0, 1)
    assert continuous_batching.rank_kv_cache(model, whole) is whole
    for rank in (0, 1):
        monkeypatch.setattr(continuous_batching, "tensor_parallel_rank", lambda _: (rank, 2))
        expected = load_kv_cache_config(checkpoint, "e4m3", rotation=rotation, tp_rank=rank, tp_size=2)
        given = continuous_batching.rank_kv_cache(model, whole)
        assert (given.k_scales, given.v_scales, given.k_offsets) == (
            expected.k_scales, expected.v_scales, expected.k_offsets)
        assert given.k_scales[0] == (whole.k_scales[0][rank],)
        # Already the rank's: as it is.
        assert continuous_batching.rank_kv_cache(model, expected) is expected


def test_per_head_values_for_another_head_count_are_refused(monkeypatch):
    model = tiny_model(num_layers=1)
    three_heads = KVCacheConfig("e4m3", [(1.0, 1.0, 1.0)], [(1.0,)], rotation="none")
    with pytest.raises(ValueError, match=r"^kv_cache has per-head scales or K offsets for 3 KV heads but the model has "
                                         r"2: give this model's KVCacheConfig"):
        enable_continuous_batching(model, three_heads)
    monkeypatch.setattr(continuous_batching, "tensor_parallel_rank", lambda _: (1, 2))
    with pytest.raises(ValueError, match=r"for 3 KV heads but the model has 2, 1 on each of its 2 tensor-parallel "
                                         r"ranks: .* or this rank's \(load_kv_cache_config\(\.\.\., tp_rank=1, "
                                         r"tp_size=2\)\)$"):
        enable_continuous_batching(model, three_heads)
    assert model.config._attn_implementation != "fp8kv"  # refused before anything is switched
