"""Per-CTA timeline of the decode kernel: builds the attention lab against a copy of csrc/ with
%globaltimer trace points added (kernel entry, block table staged, first tile landed, loop end, exit;
merge start and end), runs it with LAB_TRACE=1 and prints min/median/max of each phase per shape.
The kernel sources in the tree are not modified. Run on the GPU machine from the repository root:
    python3 benchmarks/lab/trace_lab.py [extra nvcc flags, e.g. -DFP8KV_ATTENTION_STAGES=3]
"""
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]

TRACE_DEFS = r'''
__device__ unsigned long long* fp8kv_trace;
void fp8kv_set_trace(void* p) { cudaMemcpyToSymbol(fp8kv_trace, &p, sizeof(p)); }
__device__ __forceinline__ unsigned long long now_ns() { unsigned long long t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ unsigned cta_id() { return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z); }
#define TRACE(slot) do { if (fp8kv_trace) fp8kv_trace[cta_id() * 6 + (slot)] = now_ns(); } while (0)
#define TRACE_MERGE(slot) do { if (fp8kv_trace) fp8kv_trace[6 * 65536 + blockIdx.x * 2 + (slot)] = now_ns(); } while (0)
'''

# (anchor text in paged_attention_kernel.cuh, text inserted before it)
KERNEL_POINTS = [
    ("  if (ws.num_splits > 1) allow_dependent_grid();", "  if (threadIdx.x == 0) TRACE(0);\n"),
    ("  const RowSource source", "  if (threadIdx.x == 0) TRACE(1);\n"),
    ("    read_tile<C, D>(regs, ring", "    if (k == 0 && threadIdx.x == 0) TRACE(2);\n"),
    ("  copy_async_wait<0>();\n  __syncthreads();  // the ring is reused", "  if (threadIdx.x == 0) TRACE(3);\n"),
    ("  const int64_t row = blockIdx.x;  // query_row * num_heads + head", "  if (threadIdx.x == 0) TRACE_MERGE(0);\n"),
]


def end_of_function(text: str, next_marker: str) -> int:
    """Index of the closing brace of the function that precedes next_marker."""
    return text.rindex("}\n", 0, text.index(next_marker))


def patch(source: str) -> str:
    source = source.replace("namespace fp8kv::cuda::attention {\n", "namespace fp8kv::cuda::attention {\n" + TRACE_DEFS, 1)
    for anchor, insert in KERNEL_POINTS:
        assert source.count(anchor) == 1, anchor
        source = source.replace(anchor, insert + anchor)
    at = end_of_function(source, "// Merges the splits of each (query row, head)")
    source = source[:at] + "  if (threadIdx.x == 0) TRACE(4);\n" + source[at:]
    at = end_of_function(source, "template <CacheKind C, int D>\ncudaError_t launch_head(")
    return source[:at] + "  if (threadIdx.x == 0) TRACE_MERGE(1);\n" + source[at:]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        shutil.copytree(ROOT / "csrc", work / "csrc")
        shutil.copytree(ROOT / "benchmarks" / "lab", work / "benchmarks" / "lab")
        kernel = work / "csrc" / "cuda" / "paged_attention_kernel.cuh"
        kernel.write_text(patch(kernel.read_text()))
        lab = work / "benchmarks" / "lab"
        binary = work / "attention_trace"
        subprocess.run(["nvcc", "-std=c++17", "-O3", "--expt-relaxed-constexpr",
                        "-gencode=arch=compute_90a,code=sm_90a", "-DFP8KV_LAB_TRACE", *sys.argv[1:],
                        "attention_lab.cu", "other_kinds.cu", "../../csrc/cuda/paged_attention.cu",
                        "../../csrc/cuda/paged_attention_e4m3fn.cu", "-o", str(binary)], cwd=lab, check=True)
        subprocess.run([str(binary), "trace"], env={"LAB_TRACE": "1", "PATH": "/usr/bin:/bin"}, check=True)


if __name__ == "__main__":
    main()
