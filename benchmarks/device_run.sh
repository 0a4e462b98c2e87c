#!/usr/bin/env bash
# GPU tests and benchmarks in one call on the H200 (device tool); logs and JSON under $OUT.
#   bash benchmarks/device_run.sh [STAGE ...]   stages: tests packaged profile prefill attn gemv moe tune
#   int4 w4fma w4e2e gemma4 llama fp8 eager ab verify spec serve lora
# (no stage: tests gemma4 llama eager). Each stage has its own time limit (T_<STAGE> seconds). GPU_TESTS picks
# the test files of the `tests` stage (default: tests without tests/server, whose `openai` import the device image
# lacks) and TEST_ARGS sets pytest options (default "-n 8": pytest-xdist workers sharing the GPU, the suite in
# about 210 s; pyproject's -n auto would start one per core; e.g. "-n 8 -k 'bf16 and mixtral'");
# PACKAGED_ARGS likewise for the packaged-model stage. Both stages stop pytest at their limit with SIGINT, so its
# summary of failures still prints, and write each failure's traceback as it happens to $OUT/gpu_test_failures.txt
# (tests/conftest.py, SPARROW_TEST_FAILURES). Stage options: PREFILL_ARGS (extra `sparrow bench` flags of
# the 8 x 2048 prefill profile), ATTN_ARGS (attention_prefill.py, default --tune), GEMV_ARGS (kernels_micro.py,
# default tune_gemv_fp8), TUNE_ROWS / TUNE_DTYPES / TUNE_ARGS (moe_layer.py --tune; TUNE_ARGS=--quick: prefill short list), G4_BATCHES / G4_PROMPTS,
# FP8_BATCHES / FP8_PROMPTS / FP8_ARGS, LL_BATCHES / LL_PROMPTS, PROFILE_SHAPES / PROFILE_BATCH / PROFILE_ARGS / PROFILE_TAG
# (PROFILE_BATCH: the decode batch timed and profiled, default 1). The device image lacks `gguf`: its wheel travels
# in .whl (see ../.library/device/README.md).
# Stage `int4`: the 4-bit kernels' micro-benchmarks: kernels_micro.py int4 (int4 / NVFP4 W4A16 linears at 1-16 and
# 2,048 rows beside FP8's, % of the bytes bound), then moe_layer.py at INT4_ROWS (default 1 8 64) rows for fp8 int4
# nvfp4 (one gemma4 MoE layer); INT4_ARGS adds kernels_micro.py commands (e.g. tune_int4); T_INT4 (default 400 s).
# Logs: int4_micro.log, moe_layer_int4.log / .json. Stage `w4e2e`: `sparrow bench` decode end to end for each
# of W4_FORMATS (default fp8 int4 nvfp4, each quantized at load) on W4_SHAPE (default gemma4-26b-a4b) at W4_BATCHES
# (default 1,64), one after another in one call; T_W4E2E (default 200 s) each; e2e_<format>.json / .log.
# Stage `w4fma`: the 4-bit FMA GEMV tiles: kernels_micro.py tune_w4_fma (dense, W4_FMA_ROWS, default "1 4"; writes
# configs/w4_linear_<format>_<device>.json where a tile beats the current entry), then
# moe_layer.py --tune --fma-only at W4_FMA_MOE_ROWS (default 1) for int4 and nvfp4 (writes their config files, copied to
# $OUT); each sweep compiled first in SWEEP_PROCS (12) processes at once (``sharded``), T_W4FMA (240 s) each.
# Stage `ab`: the same `sparrow bench` (AB_ARGS, default gemma4-26b-a4b FP8 at batch 1 and 8) on this tree and on an
# older one, alternating, AB_REPEATS rounds, on one machine (runs of one tree on one machine spread by up to ~5 %:
# benchmarks/README.md, "Running an A/B"). Make the older tree first, here: `mkdir -p .ab/old && git archive REV sparrow | tar -x -C .ab/old`,
# and carry `.ab` (ignored) beside `.whl`. AB_ENV_NEW / AB_ENV_OLD: environment assignments for one side, and
# AB_ARGS_OLD: the old side's bench flags (default AB_ARGS); with .ab/old a copy of this tree, an A/B of a switch
# (e.g. AB_ENV_OLD=SPARROW_PDL=0, or AB_ARGS_OLD without --quantize-lm-head). AB_TAG names the logs
# (ab${AB_TAG}_new_1.log ...), so one call can run several A/Bs. AB_SCRIPT (a path in the tree, e.g.
# benchmarks/spec_decode.py; the old tree then needs it: `git archive REV sparrow benchmarks`) runs that script of
# each side with AB_SCRIPT_ARGS instead of `sparrow bench`, printing each log's last AB_TAIL (12) lines.
# Stage `verify`: benchmarks/verify_step.py (verify step of q = 1 2 3 5 8 rows per sequence against the 1-row step,
# gemma4-26b-a4b FP8 at batch 1 and 8, then one layer's kernels at 1-8 rows); VERIFY_ARGS: its flags (e.g.
# "--batch-sizes 1 --context 1024"). Stage `spec`: benchmarks/spec_decode.py (n-gram speculation on the packaged
# Gemma 3 270M against plain decoding, batch 1 and 8); SPEC_ARGS: its flags (e.g. "--k 4 --max-tokens 256").
# Time limits T_VERIFY (default 540) and T_SPEC (default 540); JSON and logs: verify_step.*, spec_decode.*.
# Stage `serve`: benchmarks/serve.py, `sparrow serve --model-shape gemma4-26b-a4b --quantization fp8` (a subprocess)
# under 1, 8, 64 streaming clients beside the same load through LLM in-process, then the served / in-process tok/s
# ratio and the added TTFT p50; serve.json + serve.log (+ serve.server.log) under $OUT. SERVE_ARGS replaces its
# default flags (e.g. "--model-shape llama3-8b --streams 1,64 --max-tokens 64"); T_SERVE its limit (default 540 s).
# Stage `lora`: benchmarks/lora.py (decode tok/s with 8 rank-16 adapters on every projection and the experts against
# no LoRA, gemma4-26b-a4b FP8 at batch 1, 8, 64); LORA_ARGS replaces its flags, T_LORA its limit (default 540 s);
# lora.json + lora.log. The LoRA GPU tests (tests/lora) need `peft` (a .whl, as gguf's).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# GGUF files larger than one call carries travel as parts (`split -b 50000000 -d F .models/F.part`, named
# after the file: .models/NAME.gguf.part00 ...), one per
# call on a warm machine (an ignored folder stays between calls); join whatever is complete.
if ls .models/*.part00 >/dev/null 2>&1; then
  mkdir -p /tmp/gguf
  for first in .models/*.part00; do
    name=$(basename "${first%.part00}"); cat .models/"$name".part* > /tmp/gguf/"$name"
  done
  export SPARROW_GGUF_DIR=/tmp/gguf
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/gpu.txt"

sharded() {  # time limit, command...: compile a sweep's candidates in SWEEP_PROCS processes at once (SWEEP_SHARD,
  # benchmarks/gpu_timing.py), then run the sweep itself, timing from Triton's cache
  local limit=$1 n=${SWEEP_PROCS:-12} i; shift
  for i in $(seq 0 $((n - 1))); do SWEEP_SHARD=$i/$n timeout "$limit" "$@" > /dev/null 2>&1 & done; wait
  timeout "$limit" "$@"
}

bench() {  # name, time limit, sparrow bench arguments...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m sparrow bench --device cuda --out "$OUT/$name.json" "$@" 2>&1 | tee "$OUT/$name.log" | tail -40
}

for stage in ${@:-tests gemma4 llama eager}; do
  echo "=== $stage $(date +%T)"
  case $stage in
    tests) SPARROW_TEST_FAILURES="$OUT/gpu_test_failures.txt" eval timeout -s INT -k 30 "${T_TESTS:-300}" python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short -rf \
             "${TEST_ARGS:--n 8}" ${GPU_TESTS:-tests --ignore=tests/server} 2>&1 | tee "$OUT/gpu_tests.log" | tail -60 ;;
    packaged) SPARROW_TEST_FAILURES="$OUT/gpu_test_failures.txt" eval timeout -s INT -k 30 "${T_PACKAGED:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short -rf \
             "${PACKAGED_ARGS:--n 0}" tests/models/test_packaged_models_gpu.py 2>&1 | tee "$OUT/packaged_tests.log" | tail -30 ;;
    profile) for shape in ${PROFILE_SHAPES:-gemma4-26b-a4b llama3-8b}; do
               bench "profile_${shape%%-*}_b${PROFILE_BATCH:-1}${PROFILE_TAG:-}" "${T_PROFILE:-120}" --model-shape "$shape" \
                 --batch-sizes "${PROFILE_BATCH:-1}" --profile-batch "${PROFILE_BATCH:-1}" \
                 --prompt-len 128 --decode-tokens 16 --no-hf --profile ${PROFILE_ARGS:-}
             done ;;
    prefill) bench prefill_gemma4 "${T_PREFILL:-200}" --model-shape gemma4-26b-a4b --batch-sizes 8 --prompt-len 2048 \
               --decode-tokens 4 --no-hf --profile-prefill ${PREFILL_ARGS:-} ;;
    attn) timeout "${T_ATTN:-200}" python3 benchmarks/attention_prefill.py ${ATTN_ARGS:---tune} 2>&1 \
            | tee "$OUT/attention_prefill.log" ;;
    gemv) timeout "${T_GEMV:-150}" python3 benchmarks/kernels_micro.py ${GEMV_ARGS:-tune_gemv_fp8} 2>&1 \
            | tee "$OUT/kernels_micro.log" ;;
    moe) timeout "${T_MOE:-120}" python3 benchmarks/moe_layer.py --rows 1 8 64 1024 --out "$OUT/moe_layer.json" 2>&1 \
           | tee "$OUT/moe_layer.log" ;;
    int4) timeout "${T_INT4:-400}" bash -c "python3 benchmarks/kernels_micro.py int4 ${INT4_ARGS:-} 2>&1 \
            | tee '$OUT/int4_micro.log'; python3 benchmarks/moe_layer.py --rows ${INT4_ROWS:-1 8 64} \
            --dtypes fp8 int4 nvfp4 --out '$OUT/moe_layer_int4.json' 2>&1 | tee '$OUT/moe_layer_int4.log'" ;;
    w4fma) sharded "${T_W4FMA:-240}" python3 benchmarks/kernels_micro.py tune_w4_fma 2>&1 | tee "$OUT/w4_fma_dense.log" \
             | grep -E "shipped|best"
           sharded "${T_W4FMA:-240}" python3 benchmarks/moe_layer.py --tune --fma-only --rows ${W4_FMA_MOE_ROWS:-1} \
             --dtypes int4 nvfp4 2>&1 | tee "$OUT/w4_fma_moe.log" | grep -v skip
           cp sparrow/kernels/configs/*int4*.json sparrow/kernels/configs/*nvfp4*.json "$OUT/" ;;
    w4e2e) for q in ${W4_FORMATS:-fp8 int4 nvfp4}; do
             bench "e2e_${q}" "${T_W4E2E:-200}" --model-shape "${W4_SHAPE:-gemma4-26b-a4b}" --quantization "$q" \
               --batch-sizes ${W4_BATCHES:-1,64} --prompt-len 128 --decode-tokens 32 --no-hf
           done ;;
    tune) timeout "${T_TUNE:-300}" python3 benchmarks/moe_layer.py --tune ${TUNE_ARGS:-} --rows ${TUNE_ROWS:-1 8 64 1024} --dtypes ${TUNE_DTYPES:-bf16 fp8} 2>&1 \
            | tee "$OUT/moe_tune.log" | grep -v skip; cp sparrow/kernels/configs/*H200*.json "$OUT/" ;;
    gemma4) bench gemma4 "${T_G4:-400}" --model-shape gemma4-26b-a4b --batch-sizes ${G4_BATCHES:-1,8,64} \
             --prompt-len ${G4_PROMPTS:-128,2048} --decode-tokens 32 ;;
    llama) bench llama "${T_LL:-200}" --model-shape llama3-8b --batch-sizes ${LL_BATCHES:-1,8,64} \
             --prompt-len ${LL_PROMPTS:-128,2048} --decode-tokens 64 ;;
    fp8) bench gemma4_fp8 "${T_FP8:-200}" --model-shape gemma4-26b-a4b --quantization fp8 \
           --batch-sizes ${FP8_BATCHES:-1,8,64} --prompt-len ${FP8_PROMPTS:-128,2048} --decode-tokens 32 --no-hf \
           ${FP8_ARGS:-} ;;
    ab) [ -d .ab/old/sparrow ] || { echo "ab: no .ab/old/sparrow (see the header)"; continue; }
        for round in $(seq "${AB_REPEATS:-1}"); do
          for side in new old; do
            root=$PWD; [ "$side" = old ] && root=$PWD/.ab/old
            echo "--- ab $side (round $round)"
            # -P: no current directory on sys.path, or `python3 -m sparrow` would import ./sparrow for both sides
            site=; [ -d /tmp/site ] && site=/tmp/site:
            PYTHONPATH=$site$root python3 -P -c "import sparrow; print('sparrow from', sparrow.__file__)"
            side_env=$AB_ENV_NEW side_args=$AB_ARGS
            [ "$side" = old ] && side_env=$AB_ENV_OLD side_args=${AB_ARGS_OLD:-$AB_ARGS}
            if [ -n "${AB_SCRIPT:-}" ]; then
              PYTHONPATH=$site$root timeout "${T_AB:-150}" env $side_env python3 -P "$root/$AB_SCRIPT" ${AB_SCRIPT_ARGS:-} \
                > "$OUT/ab${AB_TAG:-}_${side}_$round.log" 2>&1
              tail -"${AB_TAIL:-12}" "$OUT/ab${AB_TAG:-}_${side}_$round.log"
              continue
            fi
            PYTHONPATH=$site$root timeout "${T_AB:-150}" env $side_env python3 -P -m sparrow bench --device cuda --no-hf \
              ${side_args:---model-shape gemma4-26b-a4b --quantization fp8 --batch-sizes 1,8 --prompt-len 128 --decode-tokens 32} \
              > "$OUT/ab${AB_TAG:-}_${side}_$round.log" 2>&1
            grep -E "^\[sparrow\]|Error" "$OUT/ab${AB_TAG:-}_${side}_$round.log" | tail -4
          done
        done ;;
    verify) timeout "${T_VERIFY:-540}" python3 benchmarks/verify_step.py --device cuda --out "$OUT/verify_step.json" \
              ${VERIFY_ARGS:-} 2>&1 | tee "$OUT/verify_step.log" | grep -v "capturing CUDA graphs" | tail -80 ;;
    spec) timeout "${T_SPEC:-540}" python3 benchmarks/spec_decode.py --device cuda --out "$OUT/spec_decode.json" \
            ${SPEC_ARGS:-} 2>&1 | tee "$OUT/spec_decode.log" | tail -40 ;;
    serve) timeout "${T_SERVE:-540}" python3 benchmarks/serve.py --device cuda --out "$OUT/serve.json" \
             ${SERVE_ARGS:---model-shape gemma4-26b-a4b --quantization fp8 --streams 1,8,64 --prompt-len 128 --max-tokens 128} \
             2>&1 | tee "$OUT/serve.log" | tail -20 ;;
    lora) timeout "${T_LORA:-540}" python3 benchmarks/lora.py --device cuda --out "$OUT/lora.json" \
            ${LORA_ARGS:---model-shape gemma4-26b-a4b --quantization fp8 --lora-rank 16 --num-loras 8} 2>&1 \
            | tee "$OUT/lora.log" | grep -v "capturing CUDA graphs" | tail -20 ;;
    eager) bench llama_eager "${T_EAGER:-60}" --model-shape llama3-8b --batch-sizes 1 --no-hf --enforce-eager \
             --prompt-len 128 --decode-tokens 64 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
