# Session-3 device command: kv_amax chunk size (64 tokens x 4 loads in flight vs 128 x 8): tests, bench, memcheck.
set -x
export CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
FP8KV_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0a bash scripts/dev_install.sh > $OUT/build.log 2>&1; echo "build exit $?"
python3 -m pytest -q tests/test_kv_amax.py 2>&1 | tail -1
python3 benchmarks/bench_kv_amax.py --json $OUT/kv_amax_64x4.json 2>&1 | tail -8
sed -i 's/^constexpr int kTokensPerCta = 64;/constexpr int kTokensPerCta = 128;/; s/^constexpr int kLoadsInFlight = 4;/constexpr int kLoadsInFlight = 8;/' csrc/cuda/kv_amax.cu
grep -n "^constexpr" csrc/cuda/kv_amax.cu
FP8KV_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0a bash scripts/dev_install.sh > $OUT/build2.log 2>&1; echo "build exit $?"
python3 -m pytest -q tests/test_kv_amax.py 2>&1 | tail -1
python3 benchmarks/bench_kv_amax.py --json $OUT/kv_amax_128x8.json 2>&1 | tail -8
compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitize_cuda.py > $OUT/memcheck.log 2>&1; echo "memcheck exit $?"; tail -1 $OUT/memcheck.log
