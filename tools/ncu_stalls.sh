#!/usr/bin/env bash
# Where the warps of matching kernels wait, from Nsight Compute's counters (clocks left alone):
#   tools/ncu_stalls.sh REGEX SKIP COUNT -- python3 tools/profile_layer.py --mode prefill ...
# prints, per kernel launch, duration, instructions, active warps and the stall reasons
# (average warps stalled per issued instruction), largest first.
set -euo pipefail
regex=$1 skip=$2 count=$3
shift 4
m=smsp__inst_executed.sum,gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active
m+=,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active
m+=,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__issue_active.avg.pct_of_peak_sustained_active
for s in barrier long_scoreboard short_scoreboard mio_throttle math_pipe_throttle wait \
         lg_throttle not_selected dispatch_stall no_instruction membar branch_resolving misc; do
    m+=,smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio
done
ncu --clock-control none -k "regex:$regex" --launch-skip "$skip" --launch-count "$count" \
    --metrics "$m" "$@" 2>&1 | grep -v "^==PROF==" \
    | awk '/^  [a-z_0-9]+ \(/ {print; next} /stalled/ {sub("smsp__average_warps_issue_stalled_", ""); sub("_per_issue_active.ratio", "")} NF >= 3 && $NF ~ /^[0-9.,]+$/ {print}'
