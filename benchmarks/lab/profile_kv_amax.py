"""A few kv_amax calls on the 67 MB benchmark shape (16384 tokens, 8 KV heads, head 128, bf16), to run
under ncu: ncu --kernel-name regex:kv_amax --launch-skip 3 --launch-count 1 python3 benchmarks/lab/profile_kv_amax.py"""
import torch

from fp8kv import ops

key, value = torch.randn(2, 16384, 8, 128, device="cuda", dtype=torch.bfloat16).unbind(0)
k_amax, v_amax = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
for _ in range(5):
    ops.kv_amax(key, value, k_amax, v_amax)
torch.cuda.synchronize()
print("kv_amax:", k_amax.item(), v_amax.item())
