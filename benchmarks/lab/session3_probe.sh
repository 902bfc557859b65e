# Session-3 probe (device): decode-kernel variants in the lab, package build + GPU tests + quick bench.
set -x
export CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
(FP8KV_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0a bash scripts/dev_install.sh > $OUT/build.log 2>&1; echo "build exit $?") &
OUT=/tmp bash benchmarks/lab/run_lab.sh "4 2 1" "4 2 1 -DFP8KV_ATTENTION_DEPENDENT_MERGE=0" "4 2 5" "4 3 1" "8 2 1" 2>&1 | tee $OUT/lab.txt
wait
python3 -m pytest -q -x tests/test_cuda_only.py tests/test_paged_attention.py tests/test_compile.py tests/test_opcheck.py tests/test_modules.py -k "cuda or not cpu" > $OUT/tests.log 2>&1; tail -3 $OUT/tests.log
python3 benchmarks/bench_paged_attention.py --quick --json $OUT/pa_quick.json 2>&1 | tail -9
