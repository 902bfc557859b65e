"""Seeded fuzzer for fp8kv's three ops (paged attention planned or not): no input may crash, hang, or write outside its tensors, and a
refused input gets a message naming one of the op's arguments.

A case is a valid call (random shapes, formats, layouts, strides) with one to three random changes
(sizes, dtypes, ranks, strides, devices, aliasing, index values, scalars, scale values). Every tensor
argument is a view into a larger buffer of random guard bytes: after the call, the bytes of inputs
must be unchanged, and the bytes of outputs outside their own elements too.

Each case runs in a child forked from this driver, which itself never runs a kernel (a process that
has run OpenMP regions cannot fork safely). Run directly:
    python tests/ops/fuzz_ops.py --seconds 60            # JSON lines, one per case, on stdout
    python tests/ops/fuzz_ops.py --seed 123 --in-process  # one case, with a traceback
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import select
import signal
import sys
import time

import torch

import fp8kv  # noqa: F401  (loads the ops; imported before any fork, and runs no kernel)

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz)
SOURCE = (torch.float16, torch.bfloat16, torch.float32)
QUERY = (torch.float16, torch.bfloat16)
ODD_DTYPES = (torch.int8, torch.int32, torch.int64, torch.float64, torch.bool, torch.uint8, *FP8, *SOURCE)
HEAD_SIZES = (64, 128, 256)
ARGUMENTS = {
    "reshape_and_cache": ("key", "value", "key_cache", "value_cache", "slot_mapping", "k_scale", "v_scale", "hadamard",
                          "k_offset"),
    "paged_attention": ("out", "query", "key_cache", "value_cache", "block_tables", "seq_lens", "cu_seqlens_q",
                        "softmax_scale", "k_scale", "v_scale", "sliding_window", "logits_soft_cap", "hadamard",
                        "k_offset", "fp8_math", "lse", "plan", "workspace"),
    "kv_amax": ("key", "value", "k_amax", "v_amax"),
}
OUTPUTS = {"reshape_and_cache": ("key_cache", "value_cache"), "paged_attention": ("out", "lse", "workspace"),
           "kv_amax": ("k_amax", "v_amax")}
CASE_SECONDS = 20.0  # per child; generous for a loaded 2-core machine, far below a hang


# ----------------------------------------------------------------------------- guarded tensors


class Guarded:
    """Tensors carved from buffers of random bytes; remembers each buffer to check it afterwards."""

    def __init__(self, rng: random.Random, device: str):
        self.rng = rng
        self.device = device
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, its bytes before the call)

    def tensor(self, shape, dtype, values, strides=None) -> torch.Tensor:
        """A view of `shape` (row-major, or `strides`) with a random gap of guard elements around it."""
        if strides is None:
            strides, step = [], 1
            for size in reversed(shape):
                strides.insert(0, step)
                step *= max(size, 1)
        span = 1 if 0 in shape else 1 + sum((s - 1) * st for s, st in zip(shape, strides))
        front = self.rng.randint(0, 8)
        buffer = torch.empty(front + span + self.rng.randint(1, 8), dtype=dtype, device=self.device)
        buffer.view(torch.uint8).copy_(torch.randint(0, 256, (buffer.numel() * buffer.element_size(),),
                                                     dtype=torch.uint8, generator=self._generator()))
        view = buffer.as_strided(shape, strides, front)
        if view.numel():
            view.copy_(values(view.shape).to(dtype) if callable(values) else values)
        self.buffers.append((buffer, buffer.view(torch.uint8).clone()))
        return view

    def _generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.rng.getrandbits(63))

    def randn(self, shape, dtype, scale=1.0, strides=None) -> torch.Tensor:
        g = self._generator()
        return self.tensor(shape, dtype, lambda s: torch.randn(s, generator=g) * scale, strides)

    def written_outside(self, outputs: list[torch.Tensor]) -> str | None:
        """Describes the first guard byte (or input byte) that changed, if any."""
        footprints = {}
        for out in outputs:
            if out.device.type == "meta" or out.numel() == 0:
                continue
            for buffer, _ in self.buffers:
                if out.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr():
                    mask = footprints.setdefault(id(buffer), torch.zeros(buffer.numel(), dtype=torch.bool,
                                                                         device=buffer.device))
                    mask.as_strided(out.shape, out.stride(), out.storage_offset()).fill_(True)
        for i, (buffer, before) in enumerate(self.buffers):
            allowed = footprints.get(id(buffer))
            changed = (buffer.view(torch.uint8) != before).view(buffer.numel(), buffer.element_size()).any(1)
            if allowed is not None:
                changed &= ~allowed
            if changed.any():
                return f"buffer {i} ({buffer.dtype}, {buffer.numel()} elements): element {int(changed.nonzero()[0])}"
        return None


# ----------------------------------------------------------------------------- valid calls


def layout_strides(rng, num_blocks, block_size, heads, head_size) -> tuple[list[int], list[int] | None]:
    """Strides of a key cache and, for an interleaved K/V buffer, the element offset of the value half."""
    kind = rng.choice(("NHD", "HND", "interleaved"))
    if kind == "NHD":
        return [block_size * heads * head_size, heads * head_size, head_size, 1], None
    if kind == "HND":
        return [heads * block_size * head_size, head_size, block_size * head_size, 1], None
    page = block_size * heads * head_size
    return [2 * page, heads * head_size, head_size, 1], [page]


def caches(g: Guarded, rng, num_blocks, block_size, heads, head_size, dtype):
    strides, interleaved = layout_strides(rng, num_blocks, block_size, heads, head_size)
    shape = [num_blocks, block_size, heads, head_size]
    codes = lambda s: torch.randint(0, 256, s, dtype=torch.uint8, generator=g._generator())  # noqa: E731
    if interleaved is None:
        return [g.tensor(shape, dtype, (lambda s: codes(s).view(dtype)) if dtype in FP8 else
                         (lambda s: torch.randn(s, generator=g._generator())), strides) for _ in range(2)]
    both = g.randn([num_blocks, 2, block_size, heads, head_size], torch.float32) if dtype not in FP8 else None
    buffer = g.tensor([num_blocks, 2, block_size, heads, head_size], dtype,
                      (lambda s: codes(s).view(dtype)) if dtype in FP8 else both.to(dtype))
    return [buffer[:, 0], buffer[:, 1]]


def scales(g: Guarded, rng, heads) -> list[torch.Tensor]:
    n = rng.choice((1, heads))
    return [g.tensor([n], torch.float32, lambda s: torch.rand(s, generator=g._generator()) + 0.05) for _ in range(2)]


def transform(g: Guarded, rng, heads, head_size, cache_dtype) -> dict:
    """The rotated recipe's arguments: for an FP8 cache sometimes a rotation, an offset or both."""
    if cache_dtype not in FP8:
        return dict(hadamard=False, k_offset=None)
    offset = g.randn([heads, head_size], torch.float32) if rng.random() < 0.4 else None
    return dict(hadamard=rng.random() < 0.5, k_offset=offset)


def source_pair(g: Guarded, rng, tokens, heads, head_size, dtype) -> list[torch.Tensor]:
    """key and value, plain or as slices of a fused QKV projection output."""
    if rng.random() < 0.5:
        return [g.randn([tokens, heads, head_size], dtype, 3.0) for _ in range(2)]
    fused = g.randn([tokens, 3 * heads, head_size], dtype, 3.0)
    return [fused[:, heads:2 * heads], fused[:, 2 * heads:]]


def valid_reshape_and_cache(g: Guarded, rng) -> dict:
    heads, head_size, block_size, num_blocks = rng.choice((1, 2, 4)), rng.choice(HEAD_SIZES), \
        rng.choice((1, 8, 16, 32)), rng.randint(1, 6)
    tokens = rng.choice((0, 1, 3, 8))
    src = rng.choice(SOURCE)
    key, value = source_pair(g, rng, tokens, heads, head_size, src)
    cache_dtype = rng.choice((*FP8, src))
    key_cache, value_cache = caches(g, rng, num_blocks, block_size, heads, head_size, cache_dtype)
    slots = rng.sample(range(num_blocks * block_size), min(tokens, num_blocks * block_size))
    slots = [s if rng.random() < 0.8 else -1 for s in slots]
    slot_mapping = g.tensor([len(slots)], torch.int64, torch.tensor(slots, dtype=torch.int64))
    k_scale, v_scale = scales(g, rng, heads)
    return dict(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping,
                k_scale=k_scale, v_scale=v_scale, **transform(g, rng, heads, head_size, cache_dtype))


def valid_paged_attention(g: Guarded, rng) -> dict:
    heads, group, head_size, block_size = rng.choice((1, 2, 4)), rng.choice((1, 2, 4)), rng.choice(HEAD_SIZES), \
        rng.choice((1, 8, 16, 32))
    num_seqs, decode = rng.randint(1, 4), rng.random() < 0.5
    q_lens = [1] * num_seqs if decode else [rng.randint(0, 5) for _ in range(num_seqs)]
    seq_lens = [rng.randint(max(q, 0 if decode else 1), 70) if q or decode else rng.randint(0, 70) for q in q_lens]
    max_blocks = max(1, max(-(-s // block_size) for s in seq_lens)) + rng.randint(0, 2)
    num_blocks = num_seqs * max_blocks + rng.randint(0, 3)
    ids = rng.sample(range(num_blocks), num_seqs * max_blocks)
    block_tables = g.tensor([num_seqs, max_blocks], torch.int32,
                            torch.tensor(ids, dtype=torch.int32).view(num_seqs, max_blocks))
    qt = rng.choice(QUERY)
    rows = sum(q_lens)
    query = g.randn([rows, heads * group, head_size], qt)
    out = g.randn([rows, heads * group, head_size], qt)
    cache_dtype = rng.choice((*FP8, qt))
    key_cache, value_cache = caches(g, rng, num_blocks, block_size, heads, head_size, cache_dtype)
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    k_scale, v_scale = scales(g, rng, heads)
    args = dict(out=out, query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                seq_lens=g.tensor([num_seqs], torch.int32, torch.tensor(seq_lens, dtype=torch.int32)),
                cu_seqlens_q=None if decode else g.tensor([num_seqs + 1], torch.int32, torch.tensor(cu, dtype=torch.int32)),
                softmax_scale=head_size ** -0.5, k_scale=k_scale, v_scale=v_scale,
                sliding_window=rng.choice((-1, -1, 1, 5, 40)), logits_soft_cap=rng.choice((0.0, 0.0, 30.0)),
                **transform(g, rng, heads, head_size, cache_dtype), fp8_math=False,
                lse=g.randn([rows, heads * group], torch.float32) if rng.random() < 0.3 else None,
                plan=None, workspace=None)
    if rng.random() < 0.5:  # planned once, as for a step's layers
        args["plan"] = torch.ops.fp8kv.plan_paged_attention(
            key_cache, block_tables, args["cu_seqlens_q"], rows, heads * group, args["sliding_window"], False,
            args["lse"] is not None)
        args["workspace"] = g.tensor([args["plan"][0]], torch.uint8, torch.zeros(args["plan"][0], dtype=torch.uint8))
    return args


def valid_kv_amax(g: Guarded, rng) -> dict:
    heads, head_size, tokens = rng.choice((1, 2, 4)), rng.choice(HEAD_SIZES), rng.choice((0, 1, 5, 17))
    key, value = source_pair(g, rng, tokens, heads, head_size, rng.choice(SOURCE))
    n = rng.choice((1, heads))
    return dict(key=key, value=value, k_amax=g.tensor([n], torch.float32, torch.zeros(n)),
                v_amax=g.tensor([n], torch.float32, torch.zeros(n)))


VALID = {"reshape_and_cache": valid_reshape_and_cache, "paged_attention": valid_paged_attention,
         "kv_amax": valid_kv_amax}


# ----------------------------------------------------------------------------- changes

EXTREME_INTS = (-2**63, -2**31 - 1, -2**31, -65, -2, -1, 0, 1, 2**31 - 64, 2**31 - 1, 2**31, 2**32 + 1, 2**62)
EXTREME_FLOATS = (0.0, -0.0, -1.0, math.nan, math.inf, -math.inf, 1e39, 1e-46, 1e-40, 1e30, 3.4e38)


def materializable(t) -> bool:
    """A tensor the harness may copy: not one of the huge stride-0 views it made."""
    return isinstance(t, torch.Tensor) and t.numel() <= 1 << 20


def change_size(g, rng, args, name):
    t = args[name]
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return
    dim = rng.randrange(t.dim())
    size = rng.choice((0, 1, t.shape[dim] + 1, 2**31, 2**32 + 3))
    shape = list(t.shape)
    shape[dim] = size
    if size >= 2**31:  # huge sizes only without memory: stride 0 (and an element count torch can hold)
        if t.shape[dim] and math.prod(shape) < 2**62:
            args[name] = t.narrow(dim, 0, 1).expand(shape)
    elif math.prod(shape) <= 1 << 20:
        args[name] = g.randn(shape, t.dtype) if t.is_floating_point() else \
            g.tensor(shape, t.dtype, lambda s: torch.randint(-3, 100, s))


def change_dtype(g, rng, args, name):
    t = args[name]
    if isinstance(t, torch.Tensor):  # huge (stride-0) dimensions stay without memory
        small = g.tensor([1 if s > 64 else s for s in t.shape], rng.choice(ODD_DTYPES), lambda s: torch.randint(0, 4, s))
        args[name] = small.expand(t.shape)


def change_rank(g, rng, args, name):
    t = args[name]
    if isinstance(t, torch.Tensor):
        args[name] = t.unsqueeze(0) if rng.random() < 0.5 or t.dim() < 2 else t.flatten(0, 1)


def change_last_stride(g, rng, args, name):
    t = args[name]
    if materializable(t) and t.dim() and t.shape[-1] > 1:
        wide = g.tensor([*t.shape[:-1], 2 * t.shape[-1]], t.dtype, lambda s: torch.zeros(s))
        args[name] = wide[..., ::2]


def change_device(g, rng, args, name):
    if isinstance(args[name], torch.Tensor):
        args[name] = args[name].to("meta")


def change_alias(g, rng, args, name):
    tensors = [n for n, t in args.items() if isinstance(t, torch.Tensor) and n != name]
    if isinstance(args[name], torch.Tensor) and tensors:
        t = args[rng.choice(tensors)]
        if rng.random() < 0.5 and t.device.type != "meta":  # the same memory, one element further on
            t = t.as_strided(t.shape, t.stride(), t.storage_offset() + 1)
        args[name] = t


def change_values(g, rng, args, name):
    t = args[name]
    if not materializable(t) or t.numel() == 0 or t.device.type == "meta":
        return
    values = t.clone().reshape(-1)
    i = rng.randrange(values.numel())
    if t.dtype in (torch.int32, torch.int64):
        info = torch.iinfo(t.dtype)
        values[i] = max(info.min, min(info.max, rng.choice(EXTREME_INTS)))
    elif t.dtype == torch.float32:
        values[i] = torch.tensor(rng.choice(EXTREME_FLOATS), dtype=torch.float64).float()  # 1e39 becomes inf
    args[name] = g.tensor(list(t.shape), t.dtype, values.view(t.shape))


def change_scalar(g, rng, args, name):
    if name in ("hadamard", "fp8_math"):
        args[name] = not args[name]
    elif name == "plan" and args[name] is not None:
        plan = list(args[name])
        if plan and rng.random() < 0.7:
            plan[rng.randrange(len(plan))] = rng.choice(EXTREME_INTS)
        else:
            plan = plan[:rng.randrange(len(plan) + 1)]
        args[name] = plan
    elif name == "sliding_window":
        args[name] = rng.choice(EXTREME_INTS)
    elif name in ("softmax_scale", "logits_soft_cap"):
        args[name] = rng.choice(EXTREME_FLOATS)


def change_none(g, rng, args, name):
    if name in ("cu_seqlens_q", "k_offset", "lse", "plan", "workspace"):
        args[name] = None


CHANGES = (change_size, change_dtype, change_rank, change_last_stride, change_device, change_alias, change_values,
           change_values, change_scalar, change_none)


def make_case(seed: int, device: str = "cpu"):
    rng = random.Random(seed)
    op = rng.choice(tuple(VALID))
    g = Guarded(rng, device)
    args = VALID[op](g, rng)
    changes = []
    for _ in range(rng.choice((0, 1, 1, 2, 3))):
        name, change = rng.choice(ARGUMENTS[op]), rng.choice(CHANGES)
        change(g, rng, args, name)
        changes.append(f"{change.__name__}({name})")
    return op, args, g, changes


# ----------------------------------------------------------------------------- running


def run_case(seed: int, device: str = "cpu") -> dict:
    """Runs one case in this process and judges it (no crash or hang detection here)."""
    op, args, g, changes = make_case(seed, device)
    result = {"seed": seed, "op": op, "changes": changes}
    try:
        getattr(torch.ops.fp8kv, op)(*[args[name] for name in ARGUMENTS[op]])
    except Exception as e:  # noqa: BLE001  (judged below: the type and the message)
        message = str(e).splitlines()[0] if str(e) else ""
        named = set(re.findall(r"`(\w+)`", message)) & set(ARGUMENTS[op])
        ok = isinstance(e, RuntimeError) and message.startswith(f"fp8kv.{op}: ") and bool(named)
        return {**result, "outcome": "refused" if ok else "bad error", "error": f"{type(e).__name__}: {message}"}
    if device != "cpu":
        torch.cuda.synchronize()  # a kernel fault surfaces here, as an error of the harness
    outputs = [args[name] for name in OUTPUTS[op] if isinstance(args[name], torch.Tensor)]
    stray = g.written_outside(outputs)
    return {**result, "outcome": "wrote outside its tensors" if stray else "ran", **({"where": stray} if stray else {})}


def run_forked(seed: int) -> dict:
    """Runs one case in a forked child; a signal or a timeout is a failure of its own."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read_end)
        try:
            torch.set_num_threads(1)
            report = run_case(seed)
        except BaseException as e:  # noqa: BLE001  (a failure of the harness itself is reported too)
            report = {"seed": seed, "outcome": "harness error", "error": repr(e)}
        os.write(write_end, json.dumps(report).encode())
        os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + CASE_SECONDS
    chunks = []
    while True:
        ready, _, _ = select.select([read_end], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read_end)
            return {"seed": seed, "outcome": "hang", "error": f"no answer in {CASE_SECONDS} s"}
        chunk = os.read(read_end, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return {"seed": seed, "outcome": "crash", "error": f"signal {os.WTERMSIG(status)}"}
    return json.loads(b"".join(chunks)) if chunks else {"seed": seed, "outcome": "crash", "error": "no report"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=10**9, help="at most this many cases")
    parser.add_argument("--seconds", type=float, default=60.0, help="stop starting cases after this long")
    parser.add_argument("--seed", type=int, help="run this one case in-process (with a traceback)")
    parser.add_argument("--in-process", action="store_true", help="no forked children (a crash ends the run; "
                        "the last line printed names the case); implied by --device cuda")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda: the device of every tensor; on "
                        "cuda run with FP8KV_DEBUG_CHECKS=1, since index values on the device are otherwise not read, "
                        "and under compute-sanitizer to see faults")
    args = parser.parse_args()
    in_process = args.in_process or args.device != "cpu"
    seeds = [args.seed] if args.seed is not None else range(args.first_seed, args.first_seed + args.cases)
    stop = time.monotonic() + args.seconds
    for seed in seeds:
        if time.monotonic() > stop:
            break
        print(json.dumps(run_case(seed, args.device) if in_process else run_forked(seed)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
