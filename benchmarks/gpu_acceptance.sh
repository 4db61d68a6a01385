#!/usr/bin/env bash
# What is left to check on a GPU (issues "fullshard on GPUs: correct" and "GPU speed"), in stages
# that each fit one call of the device tool (10 minutes). It runs on the machine's own python3 and
# torch (a GPU image: no venv, no download). Each step's output goes to $OUT/<step>.log (./gpu-out
# without $OUT), its last lines to the terminal, and a table of exit codes and times to
# $OUT/summary.txt, so a cut-off call still brings back what finished.
#
#   bash benchmarks/gpu_acceptance.sh tests                # tests/gpu, then the rest of the suite with CUDA visible
#   bash benchmarks/gpu_acceptance.sh train offload        # fullshard train on NCCL; offload vs FSDP2 (gpt-1.3b)
#   bash benchmarks/gpu_acceptance.sh world1 fake8 fake64  # bench.py --device cuda: gpt-1.3b world 1, gpt-7b fake 8, 64
#
# Each step has a time cap (`timeout`) so that each line above stays under the tool's 10 minutes;
# the three calls back to back keep one machine warm. Targets: benchmarks/README.md.
set -uo pipefail

out=${OUT:-gpu-out}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

step() {  # step NAME SECONDS 'COMMAND' (a bash command line; train and bench below may be used in it)
    local name=$1 limit=$2 command=$3 start code
    echo "== $name: $command"
    start=$(date +%s)
    timeout --kill-after 10 "$limit" bash -c "$command" >"$out/$name.log" 2>&1
    code=$?
    printf '%-14s rc=%-4s %5ss  %s\n' "$name" "$code" "$(($(date +%s) - start))" "$command" | tee -a "$out/summary.txt"
    tail -n 30 "$out/$name.log"
}

train() {  # the main job on one GPU: its summary shows max_memory_allocated next to the plan
    "$py" -m fullshard train --nproc 1 --model gpt-125m --layers 4 --seq 256 --mixed-precision bf16 --steps 30 "$@"
}

bench() {
    "$py" benchmarks/bench.py --device cuda --mixed-precision bf16 --seq 2048 "$@"
}
export py
export -f train bench

for stage in "$@"; do
    case $stage in
    tests)
        step env 30 'nvidia-smi; "$py" -c "import torch; print(torch.__version__, torch.version.cuda, \
torch.cuda.get_device_name(), torch.cuda.nccl.version())"'
        step tests-gpu 180 '"$py" -m pytest -q tests/gpu -rs'
        step tests-all 380 '"$py" -m pytest -q -rf tests --ignore=tests/gpu'
        ;;
    train)
        step train-bf16 90 'train'
        step train-offload 90 'train --cpu-offload'
        step demo-1gpu 90 '"$py" -m fullshard train --steps 20'  # 2 ranks, 1 GPU: says so, trains on the CPU
        ;;
    offload)
        step bench-offload 300 '"$py" benchmarks/bench_offload_gpu.py'
        ;;
    world1)
        step bench-world1 180 'bench --model gpt-1.3b --batch 4'
        ;;
    fake8)
        step bench-fake8 200 'bench --fake-world 8 --model gpt-7b --batch 1'
        ;;
    fake64)
        step bench-fake64 200 'bench --fake-world 64 --model gpt-7b --batch 1'
        ;;
    *)
        echo "unknown stage $stage (tests, train, offload, world1, fake8, fake64)" >&2
        exit 2
        ;;
    esac
done
