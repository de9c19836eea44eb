#!/usr/bin/env bash
# One call on the H200 (the workplace's `run` tool) from the repo root, the device kit copied to
# .devicekit/ (../shared/device-kit). Each results file records its provenance (bench/common.py);
# the checkout on the device has no .git, so name the commit being measured:
#   RADIX_RUNTIME_COMMIT=<hash of the commit copied there> bash bench/run_h200.sh STAGES
# Output file names are those of docs/results/. Stages, in the order given:
#   build      build the C++ radix tree in place (the servers of later stages then run it)
#   tree       bench/radix_tree.py and bench/scheduler_step.py on the host CPU
#              -> $OUT/radix_tree_cpp_vs_python_h200_host.json, scheduler_step_h200_host.json
#   tests      pytest tests/gpu
#   kernels    bench/gpu_kernels.py           -> $OUT/h200_gpu_kernels.json
#   gemv       bench/gemv_sweep.py            -> $OUT/h200_gemv_sweep.json
#   worker     bench/gpu_worker.py            -> $OUT/h200_gpu_worker.json
#   overlap    bench/overlap_probe.py: a 2 x 256-request decode step's attention beside its GEMMs
#              on two streams (page size 1 and 16) -> $OUT/h200_overlap_probe.json
#   levers     bench/decode_levers.py: batch-1 decode with KernelConfig.pdl off / on (Llama-3.1-8B
#              bf16 / FP8 / int4, Qwen3-8B, Gemma-3-12B), the split-KV attention and the family
#              shapes' GEMV configs -> $OUT/h200_decode_levers.json
#   families   tests/gpu for Qwen3 / Mistral / Gemma 3 (and the windowed and q/k-norm kernels), then
#              bench/gpu_worker.py --model qwen3-8b, mistral-7b, gemma-3-12b
#              -> $OUT/gpu_tests_families.txt, $OUT/h200_gpu_worker_<model>.json
#   ttft       bench/cached_ttft.py: cached-prefix TTFT through the server (8,192-token prompts,
#              7,936 cached) -> $OUT/h200_cached_ttft.json
#   experiments  the same plus diagnostics and variants -> $OUT/gpu_worker_experiments.json
#   int4       bench/quant.py: the int4 and FP8 GEMV block sweeps on the one-token layer's fused
#              GEMVs, then bf16, FP8 and packed int4 (W4A16) decode at batch 1 (with the sweeps'
#              winners) and prefill 8K in one run -> $OUT/h200_quant_kernels.json
#   fp8_mma    bench/quant.py: the W8A8 tensor-core GEMV's block sweep (the one-token layer's fused
#              GEMVs and the LM head, against the W8A16 and bf16 GEMVs), the FP8 prefill's GEMMs at
#              8K tokens, then bf16 / FP8 (W8A16 GEMV) / FP8 with the tensor-core GEMV (and an FP8
#              LM head; fp8_mma: on products of >= 16,384 rows, the default) / int4 (+ FP8 head)
#              decode at batch 1 and prefill 8K in one run, then
#              tests/gpu/test_fp8_gemv_gpu.py -> $OUT/h200_quant_fp8_mma.json, $OUT/gpu_tests_fp8_mma.txt
#   quant_timeline  bench/quant.py --timeline: bf16 / FP8 (W8A16 only, default, + FP8 head) / int4
#              (+ FP8 head) batch-1 decode with the graphed step by kernel role, and FP8 without
#              dependent launches -> $OUT/h200_quant_timeline.json
#   structured bench/structured.py: constrained / unconstrained decode tok/s at batch 1, 64, 256,
#              grammar compile times, jump-forward -> $OUT/h200_structured.json
#   grammar_host  bench/grammar_host.py on the GPU host's CPU: the host ms per constrained step
#              at batch 64 per --grammar-fill-threads value (0, 4, 8, the default)
#              -> $OUT/h200_grammar_host.json
#              (both stages run over .bench_tokenizer/ when the checkout has it: write it here
#              with `python bench/export_tokenizer.py --out .bench_tokenizer` and carry it; else
#              the dummy model's 259-token stand-in vocabulary)
#   host_copy  bench/host_copy.py: the host KV tier's loads / writes of 4,096 pages of the 8B
#              shape against the pinned copy, runs of 1, 16, 256 pages -> $OUT/h200_host_copy.json
#   hicache    bench/multi_turn_chat.py, docs/hicache.md's host-tier workload in a closed loop:
#              device-only, cache off, write_through, write_back, unrestricted (five servers,
#              about 8 minutes) -> $OUT/h200_hicache_closed_loop.json
#   hicache_poisson  the same workload with Poisson arrivals (6 turns a second): write_through
#              and the unrestricted pool (about 3 minutes) -> $OUT/h200_hicache_poisson.json
#   hicache_poisson_all  the Poisson workload with every server: device-only, cache off,
#              write_through, unrestricted (about 6 minutes) -> $OUT/h200_hicache_poisson_all.json
#   multiturn  bench/multi_turn_chat.py (issue 5's H200 workload) -> $OUT/h200_multi_turn.{json,png}
#   multiturn_mixed  the same with --enable-mixed-chunk -> $OUT/h200_multi_turn_mixed.{json,png}
#   multiturn_FLAGS  the same with extra server flags from $MT_FLAGS -> $OUT/h200_multi_turn_$MT_NAME.*
#   metrics    bench/metrics_overhead.py: the multi-turn workload against metrics on and
#              --disable-metrics (two servers, KV pools capped at 200,000 tokens each), interleaved
#              -> $OUT/h200_metrics_overhead.json
#   mt:NAME:FLAGS    the same with the comma-separated server flags FLAGS -> h200_multi_turn_NAME.*
#                    (e.g. mt:chunk1024:--chunked-prefill-size,1024)
#   serve:NAME:FLAGS bench/serving.py, random 4-8K-token prompts, 128 tokens out, at 1 req/s (about
#                    one at a time: a lone prompt's TTFT) and all at once (throughput), with the
#                    comma-separated server flags FLAGS -> $OUT/h200_serving_NAME.{json,png}
#   serving_gsp      bench/serving.py, generated-shared-prefix (8 groups x 16 prompts sharing a
#                    2,048-token system prompt, 128-token questions and answers), rates 8, 32, inf,
#                    cache on and off -> $OUT/h200_serving.{json,png}
#   dp_router        bench/multi_turn_chat.py against `serve --dp 2` (two replicas on the one
#                    H200, each sizing its KV pool from half the memory; docs/scaling.md), router
#                    policies cache_aware vs round_robin, token ids -> $OUT/h200_dp_router.json
#                    (needs sglang-router from bench/fetch_device_wheels.sh)
#   tp         (2+ GPUs: the nvidia-h200-x2 kind) tests/gpu/test_tensor_parallel_gpu.py, then
#              bench/tensor_parallel.py: Llama-3.1-8B shape, --tp 2 vs --tp 1 decode tok/s at
#              batch 1 and 64 -> $OUT/gpu_tests_tp.txt, $OUT/h200x2_tensor_parallel.json
#   serving_roofline  issue 21's measurements, about 7 minutes: roofline_worker, then
#                    roofline_serve:default, roofline_serve:no_gc_freeze:--disable-gc-freeze,
#                    roofline_serve:interleave:--max-consecutive-prefill-steps,1
#                    and roofline_serve:page16:--page-size,16
#   roofline_worker  bench/gpu_worker.py: decode steps of 256 and 512 requests at 1,536 tokens of
#                    context against their bandwidth roofline, graph vs eager, host and GPU time by
#                    phase, at page size 1 and (512 only) 16
#                    -> $OUT/h200_gpu_worker_large_decode.json, h200_gpu_worker_large_decode_p16.json
#   roofline_serve:NAME:FLAGS  bench/serving.py, 512 random prompts x 1000 tokens in / 1000 out, all
#                    at once, with the comma-separated server flags FLAGS: output tok/s against the
#                    workload's roofline (ceilings measured in the run), ITL p99 / p50, each
#                    server process's garbage collections -> $OUT/h200_serving_roofline_NAME.json
# The multi-turn stages keep the launched servers' logs in $OUT/logs_<name>/.
# A stage given twice writes its repeat beside the first (name_<time>).
# e.g.  bash bench/run_h200.sh tests kernels worker
set -uo pipefail
OUT=${OUT:-/tmp/h200_out}
mkdir -p "$OUT"
[ -n "${RADIX_RUNTIME_COMMIT:-}" ] || git rev-parse HEAD > /dev/null 2>&1 \
    || echo "warning: no .git and no RADIX_RUNTIME_COMMIT: results will record commit 'unknown'"
source .devicekit/setup.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton, flashinfer; print('torch', torch.__version__, 'triton', triton.__version__, 'flashinfer', flashinfer.__version__)"
python3 -c "import uvloop, httptools; print('uvloop', uvloop.__version__, 'httptools', httptools.__version__)" \
    || echo "no uvloop/httptools: the server runs on asyncio + h11 (bench/fetch_device_wheels.sh)"
status=0
TOKENIZER=""  # a real vocabulary for the constrained-decoding stages (bench/export_tokenizer.py)
[ -d .bench_tokenizer ] && TOKENIZER=.bench_tokenizer
stages=()
for stage in "$@"; do
    if [ "$stage" = serving_roofline ]; then
        stages+=(roofline_worker roofline_serve:default
                 roofline_serve:no_gc_freeze:--disable-gc-freeze
                 roofline_serve:interleave:--max-consecutive-prefill-steps,1
                 roofline_serve:page16:--page-size,16)
    else
        stages+=("$stage")
    fi
done
LARGE_DECODE_KEYS="^(copy_TBps|matmul_TFLOPs|page_size|decode_bs(256|512)_ctx1536_(ms|roofline_ms|roofline_ratio|sync_ms|graph_bs|graph_replay_ms|graph_roofline_ratio|eager_ms|eager_roofline_ratio|host_prepare_ms|host_plan_ms|profile_(graph|eager)))[ :]|by phase"
for stage in "${stages[@]}"; do
    t0=$(date +%s)
    echo "=== $stage"
    case $stage in
        build)
            timeout 300 python3 setup.py -q build_ext --inplace > "$OUT/build_ext.log" 2>&1
            python3 -c "from radix_runtime.scheduler import _radix_tree; print('C++ radix tree built')" \
                || { status=1; tail -20 "$OUT/build_ext.log"; } ;;
        tree)
            lscpu | grep -E "Model name|L2|L3" || true
            timeout 300 python3 bench/radix_tree.py --no-progress \
                --json "$OUT/radix_tree_cpp_vs_python_h200_host.json" \
                | grep -E "impl=|all |speedup|replays" || status=1
            timeout 300 python3 bench/scheduler_step.py --json "$OUT/scheduler_step_h200_host.json" \
                || status=1 ;;
        tests)
            python3 -m pytest tests/gpu -q -p no:cacheprovider --timeout 150 \
                --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.txt" || status=1 ;;
        kernels)
            timeout 240 python3 bench/gpu_kernels.py --out "$OUT/h200_gpu_kernels.json" || status=1 ;;
        gemv)
            timeout 400 python3 bench/gemv_sweep.py --out "$OUT/h200_gemv_sweep.json" || status=1
            # later stages of this call use the configurations it found
            [ -f "$OUT/h200_gemv_sweep.json" ] \
                && export RADIX_RUNTIME_GEMV_CONFIGS="$OUT/h200_gemv_sweep.json" ;;
        worker)
            timeout 300 python3 bench/gpu_worker.py --out "$OUT/h200_gpu_worker.json" || status=1 ;;
        overlap)  # writes what it measured so far when the timeout stops it
            timeout 420 python3 bench/overlap_probe.py --out "$OUT/h200_overlap_probe.json" \
                | grep -v "^  File\|^    " | tail -80 || status=1 ;;
        levers)
            timeout 300 python3 bench/decode_levers.py --out "$OUT/h200_decode_levers.json" \
                --models llama-3.1-8b:none,llama-3.1-8b:fp8,llama-3.1-8b:int4,qwen3-8b:none,gemma-3-12b:none \
                --gemv-budget-s 60 || status=1 ;;
        tp)
            python3 -m pytest tests/gpu/test_tensor_parallel_gpu.py -q -p no:cacheprovider \
                --timeout 300 2>&1 | tee "$OUT/gpu_tests_tp.txt" | tail -15 || status=1
            timeout 540 python3 bench/tensor_parallel.py --model-config llama-3.1-8b --tp 2 \
                --batch-sizes 1,64 --out "$OUT/h200x2_tensor_parallel.json" || status=1 ;;
        families)
            python3 -m pytest tests/gpu/test_model_families_gpu.py tests/gpu/test_kernels.py -q \
                -p no:cacheprovider --timeout 200 -k "families or window or head_norms or gemma" \
                2>&1 | tee "$OUT/gpu_tests_families.txt" | tail -15 || status=1
            for model in qwen3-8b mistral-7b gemma-3-12b; do
                batches=1,64,256
                [ "$model" = gemma-3-12b ] && batches=1,64  # 393 KB of KV a token
                timeout 200 python3 bench/gpu_worker.py --model "$model" --decode-batches "$batches" \
                    --large-decodes "" --no-ab \
                    --out "$OUT/h200_gpu_worker_$model.json" \
                    | grep -E "^(decode_bs1_roofline|decode_bs1_graph_roofline|prefill_8192_mfu|prefill_2048_mfu|decode_bs64_tok_s|weight_GB)" \
                    || status=1
            done ;;
        ttft)
            timeout 300 python3 bench/cached_ttft.py --model llama-3.1-8b \
                --server-args "--load-format dummy" --prompt-tokens 8192 --new-tokens 256 \
                --repeats 5 --out "$OUT/h200_cached_ttft.json" || status=1 ;;
        structured)
            timeout 580 python3 bench/structured.py --model llama-3.1-8b \
                --server-args "--load-format dummy ${TOKENIZER:+--tokenizer $TOKENIZER}" \
                --batch 1,64,256 --tokens 128 --schemas 20 --jump-repeats 2 \
                --out "$OUT/h200_structured.json" || status=1 ;;
        grammar_host)
            timeout 300 python3 bench/grammar_host.py --batch 64 --threads 0,4,8,auto \
                ${TOKENIZER:+--tokenizer $TOKENIZER} \
                --out "$OUT/h200_grammar_host.json" || status=1 ;;
        host_copy)
            timeout 300 python3 bench/host_copy.py --pages 4096 \
                --out "$OUT/h200_host_copy.json" || status=1 ;;
        hicache|hicache_poisson|hicache_poisson_all)
            if [ "$stage" = hicache ]; then
                more=(--hicache-policies write_through,write_back --compare-no-cache)
                name=closed_loop
            elif [ "$stage" = hicache_poisson_all ]; then
                more=(--request-rate 6 --hicache-policies write_through --compare-no-cache)
                name=poisson_all
            else
                more=(--request-rate 6 --hicache-policies write_through --skip-device-only)
                name=poisson
            fi
            timeout 590 python3 bench/multi_turn_chat.py --model llama-3.1-8b --clients 48 \
                --rounds 3 --system-tokens 1024 --context-tokens 1024 --user-tokens 128 \
                --answer-tokens 128 --max-inflight 6 \
                --server-args "--load-format dummy --max-total-tokens 22000" "${more[@]}" \
                --hicache-args "--hicache-ratio 6" --unrestricted-tokens 400000 \
                --out "$OUT/h200_hicache_$name.json" || status=1 ;;
        experiments)
            timeout 300 python3 bench/gpu_worker.py --experiments \
                --out "$OUT/gpu_worker_experiments.json" || status=1 ;;
        int4)
            timeout 420 python3 bench/quant.py --variants bf16,fp8,int4 --sweeps int4,fp8 \
                --out "$OUT/h200_quant_kernels.json" || status=1 ;;
        fp8_mma)
            timeout 330 python3 bench/quant.py \
                --variants bf16,fp8,fp8+head,fp8_mma,fp8_mma+head,int4,int4+head \
                --sweeps fp8_mma,prefill_gemm --out "$OUT/h200_quant_fp8_mma.json" || status=1
            timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_gemv_gpu.py \
                2>&1 | tail -30 | tee "$OUT/gpu_tests_fp8_mma.txt" || status=1 ;;
        quant_timeline)
            timeout 300 python3 bench/quant.py --no-sweep --timeline \
                --variants bf16,fp8,fp8_mma,fp8_mma+head,int4,int4+head,fp8_nopdl,fp8_mma_nopdl \
                --out "$OUT/h200_quant_timeline.json" || status=1 ;;
        metrics)
            timeout 590 python3 bench/metrics_overhead.py --model llama-3.1-8b \
                --server-args "--load-format dummy --mem-fraction-static 0.9 --max-total-tokens 200000" \
                --clients 64 --rounds 6 --system-tokens 1024 --context-tokens 512 \
                --user-tokens 128 --answer-tokens 128 --max-inflight 32 --repeats 3 \
                --out "$OUT/h200_metrics_overhead.json" || status=1 ;;
        multiturn|multiturn_mixed|multiturn_FLAGS|mt:*)
            flags="--load-format dummy" name=h200_multi_turn
            [ "$stage" = multiturn_mixed ] && flags="$flags --enable-mixed-chunk" name=h200_multi_turn_mixed
            [ "$stage" = multiturn_FLAGS ] && flags="$flags $MT_FLAGS" name=h200_multi_turn_$MT_NAME
            if [[ $stage == mt:* ]]; then
                IFS=: read -r _ mt_name mt_flags <<< "$stage"
                flags="$flags ${mt_flags//,/ }" name=h200_multi_turn_$mt_name
            fi
            [ -f "$OUT/$name.json" ] && name=${name}_$(date +%s)  # a repeat keeps the first
            marker=$(mktemp)
            timeout 420 python3 bench/multi_turn_chat.py --model llama-3.1-8b --server-args "$flags" \
                --clients 64 --rounds 6 --system-tokens 1024 --context-tokens 512 \
                --user-tokens 128 --answer-tokens 128 --max-inflight 32 --compare-no-cache \
                --out "$OUT/$name.json" --plot "$OUT/$name.png" || status=1
            mkdir -p "$OUT/logs_$name"
            find "${TMPDIR:-/tmp}" -maxdepth 2 -name 'server-*.log' -newer "$marker" \
                -exec cp {} "$OUT/logs_$name/" \; ;;
        dp_router)
            marker=$(mktemp)
            timeout 570 python3 bench/multi_turn_chat.py --model llama-3.1-8b \
                --server-args "--load-format dummy" --dp 2 \
                --router-policies cache_aware,round_robin --clients 32 --rounds 4 \
                --system-tokens 1024 --context-tokens 512 --user-tokens 128 --answer-tokens 128 \
                --max-inflight 32 --out "$OUT/h200_dp_router.json" || status=1
            mkdir -p "$OUT/logs_dp_router"
            find "${TMPDIR:-/tmp}" -maxdepth 2 -name 'server-*.log' -newer "$marker" \
                -exec cp {} "$OUT/logs_dp_router/" \; ;;
        serve:*)
            IFS=: read -r _ sv_name sv_flags <<< "$stage"
            timeout 300 python3 bench/serving.py --model llama-3.1-8b \
                --server-args "--load-format dummy ${sv_flags//,/ }" --dataset random \
                --num-prompts 32 --random-input-len 8192 --random-output-len 128 \
                --random-range-ratio 0.5 --rates 1,inf \
                --out "$OUT/h200_serving_$sv_name.json" --plot "$OUT/h200_serving_$sv_name.png" \
                || status=1 ;;
        roofline_worker)
            timeout 150 python3 bench/gpu_worker.py --decode-batches "" --no-prefill --no-ab \
                --large-decodes 256x1536,512x1536 --out "$OUT/h200_gpu_worker_large_decode.json" \
                | grep -E "$LARGE_DECODE_KEYS" || status=1
            timeout 100 python3 bench/gpu_worker.py --decode-batches "" --no-prefill --no-ab \
                --large-decodes 512x1536 --page-size 16 \
                --out "$OUT/h200_gpu_worker_large_decode_p16.json" \
                | grep -E "$LARGE_DECODE_KEYS" || status=1 ;;
        roofline_serve:*)
            IFS=: read -r _ rs_name rs_flags <<< "$stage"
            timeout 170 python3 bench/serving.py --model llama-3.1-8b \
                --server-args "--load-format dummy ${rs_flags//,/ }" --dataset random \
                --num-prompts 512 --random-input-len 1000 --random-output-len 1000 \
                --random-range-ratio 1.0 --rates inf \
                --out "$OUT/h200_serving_roofline_$rs_name.json" 2>&1 \
                | grep -vE "it/s\]|req/s\]" | tail -12 || status=1 ;;
        serving_gsp)
            timeout 400 python3 bench/serving.py --model llama-3.1-8b \
                --server-args "--load-format dummy" --dataset generated-shared-prefix \
                --num-groups 8 --prompts-per-group 16 --system-prompt-len 2048 \
                --question-len 128 --output-len 128 --rates 8,32,inf --compare-no-cache \
                --out "$OUT/h200_serving.json" --plot "$OUT/h200_serving.png" || status=1 ;;
        *)
            echo "unknown stage $stage"; status=1 ;;
    esac
    echo "=== $stage took $(( $(date +%s) - t0 ))s"
done
exit $status
