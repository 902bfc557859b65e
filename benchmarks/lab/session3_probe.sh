# Session-3 device command: ncu of kv_amax on the 67 MB shape.
set -x
export CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
FP8KV_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0a bash scripts/dev_install.sh > $OUT/build.log 2>&1; echo "build exit $?"
ncu --clock-control none --kernel-name regex:kv_amax --launch-skip 3 --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats python3 benchmarks/lab/profile_kv_amax.py > $OUT/ncu_amax.log 2>&1
grep -E "Duration|DRAM Throughput|Memory Throughput|Waves|Achieved Occupancy|Theoretical Occupancy|Grid Size|Registers|Warp Cycles|kv_amax:" $OUT/ncu_amax.log
grep -B1 -A6 "Est. Speedup" $OUT/ncu_amax.log | head -30
