#!/usr/bin/env bash
# One full call on the H200 (device tool): GPU tests, then the benchmarks; logs and JSON under $OUT.
# The device image lacks `gguf`: its wheel travels in .whl (see ../.library/device/README.md).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# GGUF files larger than one call carries travel as parts (`split -b 50000000 -d F .models/F.part`), one or
# two per call on a warm machine (an ignored folder stays between calls); join whatever is complete.
if ls .models/*.part00 >/dev/null 2>&1; then
  mkdir -p /tmp/gguf
  for first in .models/*.part00; do
    name=$(basename "${first%.part00}"); cat .models/"$name".part* > /tmp/gguf/"$name"
  done
  export SPARROW_GGUF_DIR=/tmp/gguf
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/gpu.txt"
timeout "${T_TESTS:-220}" python3 -m pytest -m gpu -q -p no:cacheprovider ${GPU_TESTS:-tests} 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
timeout "${T_G4:-200}" python3 -m sparrow bench --model-shape gemma4-26b-a4b --device cuda --batch-sizes 1,8 \
  --prompt-len 128 --decode-tokens 32 --out "$OUT/gemma4.json" 2>&1 | tee "$OUT/bench_gemma4.log" | tail -30
timeout "${T_LL:-120}" python3 -m sparrow bench --model-shape llama3-8b --device cuda --batch-sizes 1,8 \
  --prompt-len 128 --decode-tokens 64 --out "$OUT/llama.json" 2>&1 | tee "$OUT/bench_llama.log" | tail -20
timeout "${T_EAGER:-60}" python3 -m sparrow bench --model-shape llama3-8b --device cuda --batch-sizes 1 --no-hf \
  --enforce-eager --prompt-len 128 --decode-tokens 64 --out "$OUT/llama_eager.json" 2>&1 | tee "$OUT/bench_llama_eager.log" | tail -12
