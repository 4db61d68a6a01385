#!/usr/bin/env bash
# The GPU acceptance (issue 33) in one prepared run: `bash benchmarks/gpu_acceptance.sh all` on one H100
# finishes in under 8 minutes. It runs on the machine's own python3 and torch ($PYTHON; a GPU image: no
# venv, no download). Each step's output goes to $OUT/<step>.log (./gpu-out without $OUT), its command to
# $OUT/commands.txt, and a row (step, exit code, seconds, key figure) to $OUT/summary.txt as soon as it
# ends, so a cut-off call still brings back what finished (both files are this run's: rewritten at its
# start). The table is printed again at the end. No stage named: all.
#
#   bash benchmarks/gpu_acceptance.sh all                   # every stage below, in this (priority) order
#   bash benchmarks/gpu_acceptance.sh tests train           # some stages
#   bash benchmarks/gpu_acceptance.sh dry                   # all on the CPU: --device cpu, tiny models, fake group
#   DRY=1 bash benchmarks/gpu_acceptance.sh fake8 world1    # some stages on the CPU
#   bash benchmarks/gpu_acceptance.sh plan                  # the steps and their caps, nothing run
#
# Stages, steps and time caps in seconds (`timeout` each; a hang loses only its own step):
#   tests    env 10, tests-gpu 55 (tests/gpu on NCCL), tests-smoke 45 (CUDA-visible subset, $SMOKE_TESTS)   110
#   train    fullshard train on NCCL, gpt-125m x 4 layers, 20 steps: train-fp32, train-fp32-offload,
#            train-bf16, train-bf16-offload, train-int8 (bf16, --all-gather-dtype int8), 25 each           125
#            (world 1 gathers nothing, so train-int8 checks the flag and summary; the codec runs in fake64)
#   compile  compile 55 (compile_parity.py: inductor, a compiled block as a unit vs eager; cold Triton)     55
#   offload  bench-offload 45 (bench_offload_gpu.py, gpt-350m: fullshard vs FSDP2, both offloaded)         45
#   world1   bench-world1 35 (bench.py --device cuda, gpt-350m: fullshard vs the plain model)              35
#   fake8    bench-fake8 45 (bench.py --fake-world 8, gpt-7b: fullshard vs FSDP2)                          45
#   fake64   bench-fake64 35 (bench.py --fake-world 64, gpt-7b; and fullshard-int8: the CUDA codec)         35
#   total of the caps 450 s (7.5 min); $BUDGET_S (450) also clamps the whole run, so a step that starts
#   late gets only what is left (and is skipped under 3 s); start-up is inside the steps' own time.
# Outside `all` (each needs a call of its own): suite (`make test-system`, the whole suite, 400 s), demo
# (2 ranks on 1 GPU: says so and trains on the CPU).
#
# DRY=1 (or the stage `dry`) runs the same steps on the CPU: --device cpu, gpt-tiny, one or two steps, the
# fake process group for the fake worlds, gloo at world 1 (bench.py: fake world 1), tests/gpu skipped, a
# smaller smoke subset; caps are multiplied by $SLACK (3 when dry: a loaded CPU). It checks the plumbing
# (flags, paths, parsing, timeouts), not the figures. PYTHON=echo writes each step's arguments to its log
# instead (tests/test_gpu_acceptance_dry.py parses the GPU run's with each script's own parser). Targets:
# issue 33, benchmarks/README.md.
set -uo pipefail

out=${OUT:-gpu-out}
py=${PYTHON:-python3}
DRY=${DRY:-0}
stages=()
for arg in "$@"; do
    case $arg in
    dry) DRY=1 ;;
    all) stages+=(tests train compile offload world1 fake8 fake64) ;;
    *) stages+=("$arg") ;;
    esac
done
[[ ${#stages[@]} -eq 0 ]] && stages=(tests train compile offload world1 fake8 fake64)
SLACK=${SLACK:-$([[ $DRY == 1 ]] && echo 3 || echo 1)}
BUDGET_S=${BUDGET_S:-450}
PLAN=0
[[ " ${stages[*]} " == *" plan "* ]] && PLAN=1 && stages=(tests train compile offload world1 fake8 fake64)
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} DRY py out
here=$(cd "$(dirname "$0")" && pwd)
began=$(date +%s)
budget=$(awk -v b="$BUDGET_S" -v s="$SLACK" 'BEGIN { printf "%d", b * s + 0.5 }')
printf '# %s  stages: %s  dry=%s  budget %ss\n%-20s %4s %5s  %s\n' "$(date -u '+%F %T UTC')" "${stages[*]}" \
    "$DRY" "$budget" step rc s figure >"$out/summary.txt"
: >"$out/commands.txt"
planned=0

step() {  # step NAME CAP 'COMMAND' (a bash command line; train and bench below may be used in it)
    local name=$1 cap=$2 command=$3 start code limit left
    limit=$(awk -v c="$cap" -v s="$SLACK" 'BEGIN { l = int(c * s + 0.5); print (l < 1 ? 1 : l) }')
    if [[ $PLAN == 1 ]]; then
        planned=$((planned + cap))
        printf '%-20s %4s  %s\n' "$name" "$cap" "${command//\\$'\n'/}" | tee -a "$out/summary.txt"
        return
    fi
    left=$((budget - ($(date +%s) - began)))
    if ((left < 3)); then
        printf '%-20s %4s %5s  %s\n' "$name" skip 0 "skipped: the run's budget (${budget}s) is spent" \
            | tee -a "$out/summary.txt"
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name (cap ${limit}s): $command"
    echo "$name: $command" >>"$out/commands.txt"
    start=$(date +%s)
    timeout --kill-after 3 "$limit" bash -c "$command" >"$out/$name.log" 2>&1
    code=$?
    printf '%-20s %4s %5s  %s\n' "$name" "$code" "$(($(date +%s) - start))" \
        "$("$py" "$here/acceptance_figures.py" "$name" "$code" "$out" 2>&1 | tail -n 1)" | tee -a "$out/summary.txt"
    tail -n 15 "$out/$name.log"
}

train() {  # the main job on one GPU: its summary shows max_memory_allocated next to the plan
    local name=$1
    shift
    rm -f "$out/$name.jsonl"  # --metrics appends
    if [[ $DRY == 1 ]]; then
        "$py" -m fullshard train --nproc 1 --device cpu --model gpt-tiny --layers 2 --seq 32 --steps 3 \
            --metrics "$out/$name.jsonl" "$@"
    else
        "$py" -m fullshard train --nproc 1 --device cuda --model gpt-125m --layers 4 --seq 256 --steps 20 \
            --metrics "$out/$name.jsonl" "$@"
    fi
}

bench() {  # bench.py's device mode: world 1 over NCCL or rank 0 of a fake world
    if [[ $DRY == 1 ]]; then  # the model, sizes and steps below are replaced; a real world 1 becomes fake world 1
        local args=(--device cpu --mixed-precision bf16 --model gpt-tiny --seq 16 --batch 1 --warmup 1 --steps 1)
        [[ " $* " == *" --fake-world "* ]] || args+=(--fake-world 1)
        "$py" benchmarks/bench.py "$@" "${args[@]}"
    else
        "$py" benchmarks/bench.py --device cuda --mixed-precision bf16 --seq 2048 --warmup 2 --steps 6 "$@"
    fi
}
export -f train bench

if [[ $DRY == 1 ]]; then
    smoke=${SMOKE_TESTS:-tests/test_param_shard_of.py}
    device=(--device cpu)
    compile_args="--device cpu --dim 64 --seq 32 --steps 2"
    offload_args="--device cpu --model gpt-tiny --seq 32 --batch 2 --warmup 1 --steps 1"
else
    smoke=${SMOKE_TESTS:-tests/test_fake_pg.py tests/test_train.py tests/test_grad_scaler.py}  # their inner-loop tests
    device=(--device cuda)
    compile_args="--device cuda"
    offload_args="--model gpt-350m --batch 4 --seq 1024 --warmup 1 --steps 3"
fi

for stage in "${stages[@]}"; do
    case $stage in
    tests)
        step env 10 '{ nvidia-smi -L || true; } 2>&1; "$py" -c "import torch, pytest, tqdm, fullshard; \
c = torch.cuda.is_available(); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \
torch.cuda.get_device_name() if c else \"no GPU\", \"nccl\", \".\".join(map(str, torch.cuda.nccl.version())) if c else \"-\")"'
        step tests-gpu 55 '"$py" -m pytest -q -rs tests/gpu'
        step tests-smoke 45 "\"\$py\" -m pytest -q -rf -m 'not slow and not libraries and not launch' $smoke"
        ;;
    train)
        step train-fp32 25 'train train-fp32'
        step train-fp32-offload 25 'train train-fp32-offload --cpu-offload'
        step train-bf16 25 'train train-bf16 --mixed-precision bf16'
        step train-bf16-offload 25 'train train-bf16-offload --mixed-precision bf16 --cpu-offload'
        step train-int8 25 'train train-int8 --mixed-precision bf16 --all-gather-dtype int8'
        ;;
    compile)
        step compile 55 "\"\$py\" benchmarks/compile_parity.py --backend ${COMPILE_BACKEND:-inductor} $compile_args"
        ;;
    offload)
        step bench-offload 45 "\"\$py\" benchmarks/bench_offload_gpu.py $offload_args"
        ;;
    world1)
        step bench-world1 35 'bench --model gpt-350m --batch 4 --frameworks fullshard,local'
        ;;
    fake8)
        step bench-fake8 45 'bench --fake-world 8 --model gpt-7b --batch 1 --frameworks fullshard,fsdp2'
        ;;
    fake64)
        step bench-fake64 35 'bench --fake-world 64 --model gpt-7b --batch 1 --frameworks fullshard,fsdp2,fullshard-int8'
        ;;
    suite)
        step suite 400 "make test-system SYSTEM_PYTHON=\"\$py\""
        ;;
    demo)
        step demo-1gpu 90 '"$py" -m fullshard train --steps 20'  # 2 ranks, 1 GPU: says so, trains on the CPU
        ;;
    *)
        echo "unknown stage $stage (all, dry, plan, tests, train, compile, offload, world1, fake8, fake64, suite, demo)" >&2
        exit 2
        ;;
    esac
done

if [[ $PLAN == 1 ]]; then
    echo "caps: ${planned}s in all (budget ${BUDGET_S}s)" | tee -a "$out/summary.txt"
    exit 0
fi
echo "total $(($(date +%s) - began))s (budget ${budget}s)" >>"$out/summary.txt"
echo
echo "== summary ($out/summary.txt)"
cat "$out/summary.txt"
