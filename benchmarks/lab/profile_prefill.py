"""Runs fp8kv's multi-token kernel on one prefill-like shape a few times, for ncu:

    ncu -k regex:prefill_attention --launch-skip 3 --launch-count 1 --section SpeedOfLight \
        --section WarpStateStats python3 benchmarks/lab/profile_prefill.py [batch q_len cached]
"""

import sys

import torch

import fp8kv

batch, q_len, cached = (int(x) for x in sys.argv[1:4]) if len(sys.argv) > 3 else (1, 4096, 0)
num_heads, num_kv_heads, head_size, block_size = 32, 8, 128, 16
seq_len = cached + q_len
pages = -(-seq_len // block_size)
device = "cuda"
key_cache = torch.randn(batch * pages, block_size, num_kv_heads, head_size, device=device).to(torch.float8_e4m3fn)
value_cache = torch.randn_like(key_cache, dtype=torch.float32).to(torch.float8_e4m3fn)
tables = torch.randperm(batch * pages, device=device, dtype=torch.int32).view(batch, pages)
seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=device) * q_len
query = torch.randn(batch * q_len, num_heads, head_size, device=device, dtype=torch.bfloat16)
out = torch.empty_like(query)
scale = torch.ones(1, device=device)
for _ in range(5):
    fp8kv.ops.paged_attention(out, query, key_cache, value_cache, tables, seq_lens, cu_seqlens_q,
                              head_size**-0.5, scale, scale)
torch.cuda.synchronize()
print("ok", out.float().abs().mean().item())
