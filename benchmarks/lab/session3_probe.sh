# Session-3 device command: build, per-CTA trace, GPU tests, memcheck and racecheck.
set -x
export CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
(FP8KV_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0a bash scripts/dev_install.sh > $OUT/build.log 2>&1; echo "build exit $?") &
python3 benchmarks/lab/trace_lab.py > $OUT/trace.txt 2>&1; tail -c 3000 $OUT/trace.txt
wait
python3 -m pytest -q tests/test_cuda_only.py tests/test_paged_attention.py tests/test_compile.py tests/test_opcheck.py tests/test_modules.py -k "cuda or not cpu" > $OUT/tests.log 2>&1; tail -3 $OUT/tests.log
start=$(date +%s); compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitize_cuda.py > $OUT/memcheck.log 2>&1; echo "memcheck exit $? in $(( $(date +%s) - start )) s"; tail -3 $OUT/memcheck.log
start=$(date +%s); compute-sanitizer --tool racecheck --error-exitcode 1 python3 scripts/sanitize_cuda.py --small > $OUT/racecheck.log 2>&1; echo "racecheck exit $? in $(( $(date +%s) - start )) s"; tail -3 $OUT/racecheck.log
