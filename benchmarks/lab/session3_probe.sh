set -x
cd benchmarks/lab
nvcc -std=c++17 -O3 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a bulk_lab.cu -o /tmp/bulk_lab > $OUT/build_bulk.log 2>&1 &
nvcc -std=c++17 -O3 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a attention_lab.cu other_kinds.cu ../../csrc/cuda/paged_attention.cu ../../csrc/cuda/paged_attention_e4m3fn.cu -o /tmp/attn_lab > $OUT/build_attn.log 2>&1 &
wait
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
/tmp/bulk_lab 2>&1 | tee $OUT/bulk_lab.txt
echo "variant    | B1 32k         | B1 128k        | B16 4k         | B64 4k         | B16 16k        | B128 2k        | B256 1k        | MHA B64 4k     | MQA B64 4k"
/tmp/attn_lab base | tee $OUT/attn_lab.txt
ncu --clock-control none --kernel-name regex:"paged_attention_kernel|merge_splits" --launch-skip 20 --launch-count 4 --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__registers_per_thread,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,sm__warps_active.avg.pct_of_peak_sustained_active /tmp/attn_lab b1 > $OUT/ncu_b1.log 2>&1
grep -E "paged_attention_kernel|merge_splits|duration|dram__|grid_size|registers|limit|warps_active" $OUT/ncu_b1.log | head -60
LAB_FEW=1 ncu --clock-control none --kernel-name regex:paged_attention_kernel --launch-skip 30 --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats --section SchedulerStats /tmp/attn_lab b64 > $OUT/ncu_b64.log 2>&1
tail -c 9000 $OUT/ncu_b64.log
