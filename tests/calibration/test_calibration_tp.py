"""Tensor-parallel calibration with real process groups: 2 processes (gloo on CPU, NCCL on two GPUs)
give exactly the maxima and scales of one process (TP=1), only rank 0 writes the checkpoint, and
a NaN on one rank fails every rank. Plus the reduction's other layouts with 4 CPU processes.

Each rank runs the same model (same seed, same process-local arithmetic as its own TP=1 run) and
observes only its share of the KV heads, exactly as a tensor-parallel rank's attention receives
them; so the test isolates what calibration adds under TP, the reduction, which must be exact.
"""

import pathlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("transformers")
from fp8kv.calibration import CalibrationError, KVCalibrator, export_checkpoint, observe_model  # noqa: E402
from fp8kv.checkpoint import load_kv_cache_config  # noqa: E402


class LocalHeads(KVCalibrator):
    """A rank's calibrator: sees the KV heads `heads` of the full model's K/V."""

    def __init__(self, model, granularity: str, heads: slice):
        config = model.config
        super().__init__(config.num_hidden_layers, config.num_key_value_heads, granularity)
        self.heads = heads

    def observe(self, layer, key, value):
        super().observe(layer, key[:, self.heads], value[:, self.heads])


def rank_heads(rank: int, world: int, num_kv_heads: int) -> slice:
    """The KV heads of tensor-parallel rank `rank` (split evenly, or one replicated head per rank)."""
    if num_kv_heads >= world:
        per_rank = num_kv_heads // world
        return slice(rank * per_rank, (rank + 1) * per_rank)
    head = rank // (world // num_kv_heads)
    return slice(head, head + 1)


def run(world: int, worker, *args):
    mp.spawn(worker, args=(world, *args), nprocs=world, join=True)


def init(rank: int, world: int, store: pathlib.Path, backend: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)


# ----------------------------------------------------------------------------- 2 ranks, a real model


def model_worker(rank: int, world: int, tmp: pathlib.Path, backend: str) -> None:
    from test_calibration import BATCHES, tiny_model, token_batches

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    if rank == 0:
        tiny_model(4).save_pretrained(tmp / "model")
    batches = token_batches(BATCHES * 2)
    cases = [(heads, granularity) for heads in (4, 2, 1) for granularity in ("tensor", "head")]
    models = {heads: tiny_model(heads, dtype=torch.bfloat16).to(device) for heads in (4, 2, 1)}

    # TP=1: this process alone, all heads, before any process group exists.
    expected = {}
    for heads, granularity in cases:
        calibrator = KVCalibrator.for_model(models[heads], granularity)
        observe_model(models[heads], batches, calibrator, progress=False)
        expected[heads, granularity] = calibrator.result()

    init(rank, world, tmp / "store", backend)
    for heads, granularity in cases:  # tensor parallel: this rank's heads, all the data
        calibrator = LocalHeads(models[heads], granularity, rank_heads(rank, world, heads))
        observe_model(models[heads], batches, calibrator, progress=False)
        assert calibrator.result() == expected[heads, granularity], (heads, granularity)
    for granularity in ("tensor", "head"):  # data parallel: all heads, this rank's half of the data
        calibrator = KVCalibrator.for_model(models[2], granularity)
        observe_model(models[2], batches[rank::world], calibrator, progress=False)
        amax = calibrator.result()
        assert (amax.k, amax.v) == (expected[2, granularity].k, expected[2, granularity].v), granularity

    # Only rank 0 writes; every rank returns once it is written, and it loads back exactly.
    scales = expected[4, "head"].scales()
    assert export_checkpoint(tmp / "model", tmp / f"out{rank}", scales) == tmp / f"out{rank}"
    assert (tmp / "out0" / "config.json").exists() and not (tmp / "out1").exists()
    loaded = load_kv_cache_config(tmp / "out0", "float8_e4m3fn", rotation="none")
    assert (loaded.k_scales, loaded.v_scales) == (scales.k_scales, scales.v_scales)

    # A NaN on rank 1 only fails every rank, naming the layer (and the head in global order).
    for granularity in ("tensor", "head"):
        calibrator = LocalHeads(models[4], granularity, rank_heads(rank, world, 4))
        key = torch.ones(3, 4, 16, device=device)
        if rank == 1:
            key[1, 3, 5] = torch.nan  # this rank's local head 1 is global head 3
        for layer in range(2):
            calibrator.observe(layer, key, key)
        amax = calibrator.result()
        with pytest.raises(CalibrationError, match="layer 0 K" + (" head 3" if granularity == "head" else "")):
            amax.scales()
    dist.destroy_process_group()


def test_two_gloo_ranks_give_the_tp1_scales_exactly(tmp_path):
    run(2, model_worker, tmp_path, "gloo")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_nccl_ranks_give_the_tp1_scales_exactly(tmp_path):
    run(2, model_worker, tmp_path, "nccl")


# ----------------------------------------------------------------------------- 4 ranks, the reduction alone


def reduction_worker(rank: int, world: int, tmp: pathlib.Path) -> None:
    from fp8kv import distributed

    init(rank, world, tmp / "store", "gloo")
    for heads in (8, 4, 2, 1):
        # Global per-head maxima [2 (K, V), 3 layers, heads], all distinct: a misplaced head shows.
        full = torch.arange(2 * 3 * heads, dtype=torch.float32).reshape(2, 3, heads) + 1
        share = rank_heads(rank, world, heads)
        local = full[..., share]
        if heads < world:  # replicated head: its copies on other ranks differ, the largest must win
            local = local - rank % (world // heads)
        assert torch.equal(distributed.reduce_amax(local.contiguous(), "head", heads, None), full), heads
    # Per tensor: MAX over ranks, and a NaN on one rank wins even though MAX is ambiguous on NaN.
    local = torch.full((2, 3, 1), float(rank))
    if rank == 2:
        local[1, 1, 0] = torch.nan
    result = distributed.reduce_amax(local, "tensor", 8, None)
    expected = torch.full((2, 3, 1), float(world - 1))
    expected[1, 1, 0] = torch.nan
    assert torch.equal(result.isnan(), expected.isnan()) and torch.equal(result.nan_to_num(), expected.nan_to_num())
    # Every rank holding all heads (data parallel): MAX per head.
    full = torch.rand(2, 3, 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(distributed.reduce_amax(full - rank, "head", 8, None), full)
    # A rank with a different share fails on every rank instead of hanging.
    with pytest.raises(ValueError, match="different amax shapes"):
        distributed.reduce_amax(full[..., :2 if rank == 3 else 1].contiguous(), "head", 4, None)
    with pytest.raises(ValueError, match="does not split num_kv_heads=6"):
        distributed.reduce_amax(full[..., :1].contiguous(), "head", 6, None)
    # A writer that fails fails every rank.

    def write():
        raise OSError("disk full")

    with pytest.raises(OSError if rank == 0 else RuntimeError, match="disk full"):
        distributed.on_writer(write)
    dist.destroy_process_group()


def test_reduction_layouts_on_four_gloo_ranks(tmp_path):
    run(4, reduction_worker, tmp_path)
