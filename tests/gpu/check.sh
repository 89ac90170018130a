#!/bin/bash
# A lent GPU's whole check in one call (../shared/GPU.md, items 1-3): install what the
# device image lacks, then the stages named in $STAGES (default: all, in this order):
#   suite     the whole suite, pytest -n 16 (the device-group tests apart, -n 4)
#   tests     the CUDA-relevant tests, pytest -n 16 (the device-group tests apart, -n 4:
#             each runs two or more CPU ranks, and 16 at once time out)
#   quant     compressed-weight kernels checked and timed (tests/gpu/quant_bench.py: Triton
#             int4/int8 and GGUF, fp8 _scaled_mm, beside bf16 F.linear; T_QUANT s, 150;
#             then sparse tiles against cuBLAS, as the stage sparse does)
#   sparse    sparse tiles against cuBLAS (python -m fusegen.kernels.triton_sparse_bench --bench,
#             T_SPARSE s, 240)
#   new       the test files in $NEW_TESTS on the GPU, pytest -n 8 (T_NEW s, 150): the
#             CUDA paths a session has just built, checked before its benchmarks
#   profile   decode steps eagerly and with CUDA graphs (tests/gpu/decode_profile.py)
#   benchB    fusegen beside transformers' static batch of 64, 64 requests
#   bench1k   fusegen alone on gpu-8b-1k (1000 in / 1000 out), $REQ_1K requests (256)
#   benchA    fusegen alone, 512 requests, with the time left
#   anchors   the anchors' workloads (--workload sharegpt-like, 1,000 requests, transformers'
#             static batch on the first $HF_REQ (16); then with asynchronous scheduling;
#             random-1k-1k, $REQ_1K requests; sharegpt-like with FP8 weights), each while
#             the call's time lasts; then deterministic mode beside the ordinary run on
#             $REQ_DET (256) requests; $ANCHORS picks among sharegpt, sharegpt_async, 1k1k,
#             sharegpt_fp8, det (default: all)
#   offload   gpu-offload (a 32B Llama shape, $OFF_LAYERS layers (32): about 31 GB against
#             the preset's 24 GiB device budget, so a quarter of the layers stream from
#             pinned host memory) beside accelerate's offload on the first $OFF_HF (8)
#             requests, $OFF_REQ (128) requests, T_OFF s (300) at most of what is left
#   coop      cooperative KV against swapping and recompute, the host part on the CPU's
#             cores (python -m fusegen.jobs.bench.cooperative_kv --device cuda; T_COOP s, 90,
#             at most what is left after the anchors)
# on the bench's gpu-8b shape with LAYERS decoder layers (32, the default, is the whole
# Llama-3-8B; fewer build and load in a fraction of the time).
#
# Here, first: echo /.whl/ >> .git/info/exclude, and download the py3.12 wheels of what
# the image lacks into .whl (dask, distributed, partd, locket, tblib, zict, tornado,
# croniter, gguf, llguidance, jsonschema, jsonschema-specifications, referencing,
# rpds-py; see the device tool's README). Then run, carrying .whl:
#   STAGES=tests,profile bash tests/gpu/check.sh TOTAL_S TESTS_S PROFILE_S BENCH_B_S [LAYERS]
# Every stage writes under $OUT as it goes (pytest -v streams each result,
# tests/gpu/instafail.py each failure's report), so a stage cut off by its timeout still
# reports what it did; no more than the 8 files a call brings back. Sizes seen on an
# H200 at 8 layers: tests 160 s were not quite enough; transformers' batch of 64 did not
# finish in 55 s (it runs to its longest budget, 1,024 tokens): give benchB 150 s.
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 FUSEGEN_CACHE_DIR=/tmp/fgcache
END=$(( $(date +%s) + $1 )); T_TESTS=$2; T_PROF=$3; T_B=$4; LAYERS=${5:-32}
STAGES=",${STAGES:-tests,profile,benchB,benchA},"  # or suite, bench1k
stage() { [[ "$STAGES" == *",$1,"* ]]; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl 2>&1 | tail -2
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -2
python3 -c "import fusegen.jobs.cli" 2>/dev/null || {
  mkdir -p /tmp/pp; ln -sfn "$PWD" /tmp/pp/fusegen; export PYTHONPATH=/tmp/pp; }
python3 -c "import fusegen, torch, triton, transformers; print(fusegen.__file__, 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u
if stage suite; then
  # The whole suite with the GPU visible (S3 tests need moto, absent there), then the
  # device-group tests in a slot of their own.
  T_GROUPS=$(( T_TESTS / 4 ))
  PYTHONPATH=$PYTHONPATH:tests/gpu timeout $(( T_TESTS - T_GROUPS )) python3 -m pytest -v \
      -p no:cacheprovider -p instafail -n 16 --timeout 120 --tb=short tests \
      --ignore=tests/gpu --ignore=tests/test_parallel.py --ignore=tests/test_parallel_jobs.py \
      --ignore=tests/test_jobs_s3.py > $OUT/tests.log 2>&1
  echo "suite rc=$?"
  PYTHONPATH=$PYTHONPATH:tests/gpu timeout $T_GROUPS python3 -m pytest -v -p no:cacheprovider \
      -p instafail -n 4 --timeout 150 --tb=short tests/test_parallel.py \
      tests/test_parallel_jobs.py >> $OUT/tests.log 2>&1
  echo "device-group tests rc=$?"
  grep -cE " PASSED " $OUT/tests.log; grep -cE " SKIPPED " $OUT/tests.log
  grep -E " (FAILED|ERROR) " $OUT/tests.log | sed 's/.* \(FAILED\|ERROR\) //' | cut -c1-150 | sort -u | head -60
  grep -E "^E  |^====" $OUT/failures.log 2>/dev/null | cut -c1-220 | head -80
fi
if stage tests; then
  T_GROUPS=$(( T_TESTS / 4 ))
  PYTHONPATH=$PYTHONPATH:tests/gpu timeout $(( T_TESTS - T_GROUPS )) python3 -m pytest -v \
      -p no:cacheprovider -p instafail -n 16 --timeout 60 --tb=short \
      tests/test_kernels_*.py tests/test_engine_*.py tests/test_offload.py tests/test_triton_engine.py \
      tests/test_prefix_cache.py tests/test_scheduler.py tests/test_models_*.py tests/test_sampling_options.py \
      tests/test_structured.py tests/test_weights_packed.py tests/test_placement.py \
      tests/test_loader.py > $OUT/tests.log 2>&1
  echo "tests rc=$?"
  PYTHONPATH=$PYTHONPATH:tests/gpu timeout $T_GROUPS python3 -m pytest -v -p no:cacheprovider \
      -p instafail -n 4 --timeout 120 --tb=short tests/test_parallel.py >> $OUT/tests.log 2>&1
  echo "device-group tests rc=$?"; grep -cE " PASSED " $OUT/tests.log
  grep -E " (FAILED|ERROR) " $OUT/tests.log | sed 's/.* \(FAILED\|ERROR\) //' | cut -c1-150 | sort -u | head -40
  grep -E "^E  |^====" $OUT/failures.log 2>/dev/null | cut -c1-220 | head -60
fi
if stage quant; then
  timeout "${T_QUANT:-150}" python3 tests/gpu/quant_bench.py $OUT > $OUT/quant.log 2>&1
  echo "quant rc=$?"; grep -E "^check|^invariance" $OUT/quant.log | grep -vE " ok$" | cut -c1-300
  sed -n '/^layer /,$p' $OUT/quant.log | tail -40
fi
if stage quant || stage sparse; then
  timeout "${T_SPARSE:-240}" python3 -m fusegen.kernels.triton_sparse_bench --bench > $OUT/sparse.log 2>&1
  echo "sparse bench rc=$?"; tail -14 $OUT/sparse.log
fi
if stage new; then
  PYTHONPATH=$PYTHONPATH:tests/gpu timeout "${T_NEW:-150}" python3 -m pytest -v -p no:cacheprovider \
      -p instafail -n 8 --timeout 120 --tb=short $NEW_TESTS > $OUT/new_tests.log 2>&1
  echo "new tests rc=$?"; grep -cE " PASSED " $OUT/new_tests.log; grep -cE " SKIPPED " $OUT/new_tests.log
  grep -E " (FAILED|ERROR) " $OUT/new_tests.log | sed 's/.* \(FAILED\|ERROR\) //' | cut -c1-150 | sort -u | head -30
  grep -E "^E  |^====" $OUT/failures.log 2>/dev/null | cut -c1-220 | head -50
fi
stage profile || stage anchors || stage offload || stage coop || stage benchB || stage bench1k || stage benchA || { date -u; exit 0; }
if stage profile || stage anchors || stage benchB || stage bench1k || stage benchA; then
# the gpu-8b checkpoint (offload and coop build their own models)
CKPT=$(python3 -c "
from fusegen.jobs.bench.presets import PRESETS
from fusegen.jobs.bench.checkpoint import default_cache_dir, ensure_checkpoint
preset = PRESETS['gpu-8b'].shrink(num_layers=$LAYERS)
print(ensure_checkpoint('gpu-8b', preset.model, default_cache_dir()))" | tail -1)
echo "checkpoint $CKPT"; date -u
fi
if stage profile; then
  timeout "$T_PROF" python3 tests/gpu/decode_profile.py "$CKPT" $OUT > $OUT/profile.log 2>&1
  echo "profile rc=$?"; grep -E "batch|gpu busy|Error|error" $OUT/profile.log | cut -c1-400
fi
if stage benchB; then
  timeout "$T_B" python3 -m fusegen.jobs.cli bench --preset gpu-8b --layers "$LAYERS" --requests 64 --hf-batch-size 64 --skip-hf-continuous --json /tmp/bench_b.json > $OUT/bench_b.log 2>&1
  echo "bench B rc=$?"; tail -16 $OUT/bench_b.log
fi
if stage bench1k; then
  # The anchors' fixed lengths (1000 in / 1000 out) on the same checkpoint.
  ln -sfn "$CKPT" "$(dirname "$CKPT")/gpu-8b-1k-$(basename "$CKPT" | sed 's/^gpu-8b-//')"
  timeout "$T_B" python3 -m fusegen.jobs.cli bench --preset gpu-8b-1k --layers "$LAYERS" --requests "${REQ_1K:-256}" --skip-hf --json /tmp/bench_1k.json > $OUT/bench_1k.log 2>&1
  echo "bench 1k rc=$?"; tail -14 $OUT/bench_1k.log
fi
if stage benchA; then
  LEFT=$(( END - $(date +%s) - 5 ))
  echo "bench A gets $LEFT s"
  timeout "$LEFT" python3 -m fusegen.jobs.cli bench --preset gpu-8b --layers "$LAYERS" --requests 512 --skip-hf --json /tmp/bench_a.json > $OUT/bench_a.log 2>&1
  echo "bench A rc=$?"; tail -12 $OUT/bench_a.log
fi
if stage anchors; then
  # name, seconds it needs at least, then the bench's arguments; each runs while the
  # call's time lasts (the first one loads the checkpoint into the page cache)
  anchor() {
    local name=$1 need=$2; shift 2; local left=$(( END - $(date +%s) - 5 ))
    if (( left < need )); then echo "anchor $name skipped: $left s left"; return; fi
    timeout "$left" python3 -m fusegen.jobs.cli bench --preset gpu-8b --layers "$LAYERS" \
        --json "/tmp/anchor_$name.json" "$@" > "$OUT/anchor_$name.log" 2>&1
    echo "anchor $name rc=$? ($(( $(date +%s) - END + left + 5 )) s)"; tail -14 "$OUT/anchor_$name.log"
  }
  ANCHORS=" ${ANCHORS:-sharegpt sharegpt_async 1k1k sharegpt_fp8 det} "
  [[ $ANCHORS == *" sharegpt "* ]] && anchor sharegpt 60 --workload sharegpt-like \
      --hf-requests "${HF_REQ:-16}" --hf-batch-size "${HF_REQ:-16}" --skip-hf-continuous
  [[ $ANCHORS == *" sharegpt_async "* ]] && anchor sharegpt_async 50 --workload sharegpt-like \
      --skip-hf --async-scheduling
  [[ $ANCHORS == *" 1k1k "* ]] && anchor 1k1k 60 --workload random-1k-1k \
      --requests "${REQ_1K:-256}" --skip-hf
  [[ $ANCHORS == *" sharegpt_fp8 "* ]] && anchor sharegpt_fp8 50 --workload sharegpt-like \
      --skip-hf --quantization fp8
  # deterministic mode's cost on the GPU (batch-invariant kernels) beside the ordinary run
  [[ $ANCHORS == *" det "* ]] && anchor det 60 --requests "${REQ_DET:-256}" --skip-hf \
      --deterministic-too
fi
if stage offload; then  # its own checkpoint: the 32B shape, cut to OFF_LAYERS layers
  LEFT=$(( END - $(date +%s) - 5 )); T=$(( LEFT < ${T_OFF:-300} ? LEFT : ${T_OFF:-300} ))
  if (( T < 120 )); then echo "offload skipped: $LEFT s left"; else
    timeout "$T" python3 -m fusegen.jobs.cli bench --preset gpu-offload --layers "${OFF_LAYERS:-32}" \
        --requests "${OFF_REQ:-128}" --hf-requests "${OFF_HF:-8}" --skip-hf-continuous \
        --json /tmp/bench_offload.json > $OUT/offload.log 2>&1
    echo "offload rc=$?"; tail -16 $OUT/offload.log
  fi
fi
if stage coop; then  # after the anchors, in what time is left (T_COOP s at most, 90)
  LEFT=$(( END - $(date +%s) - 5 )); T=$(( LEFT < ${T_COOP:-90} ? LEFT : ${T_COOP:-90} ))
  if (( T < 40 )); then echo "coop skipped: $LEFT s left"; else
    timeout "$T" python3 -m fusegen.jobs.bench.cooperative_kv --device cuda > $OUT/coop.log 2>&1
    echo "coop rc=$?"; tail -16 $OUT/coop.log
  fi
fi
date -u
