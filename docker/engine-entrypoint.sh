#!/usr/bin/env bash
# Start one SGLang PD worker from the environment (the engine image's entry point).
#
#   SGLANG_DISAGGREGATION_MODE  prefill | decode                         (required)
#   SGLANG_MODEL_PATH           model directory inside the container      (required)
#   SGLANG_SERVED_MODEL_NAME    name the worker reports                   (optional)
#   SGLANG_PORT                 HTTP port (default 30000)
#   SGLANG_BOOTSTRAP_PORT       prefill's bootstrap server (default 8998)
#   SGLANG_LOAD_FORMAT          auto | dummy (dummy: random weights, for smoke tests)
#   SGLANG_CONTEXT_LENGTH       advertised context length (engine_patch refuses to start a
#                               worker whose KV pool is smaller; see docs/operations.md)
#   SGLANG_MAX_TOTAL_TOKENS     KV pool size cap, SGLANG_MEM_FRACTION_STATIC its GPU share
#   SGLANG_TP_SIZE              tensor parallel size
#   MOONCAKE_PROTOCOL           rdma (default) | tcp; SGLANG_IB_DEVICE e.g. mlx5_0 for rdma
#   SGLANG_EXTRA_ARGS           anything else, appended as is
# Arguments given to the container are appended too.
set -euo pipefail

mode=${SGLANG_DISAGGREGATION_MODE:?set SGLANG_DISAGGREGATION_MODE to prefill or decode}
args=(
  --model-path "${SGLANG_MODEL_PATH:?set SGLANG_MODEL_PATH}"
  --host 0.0.0.0
  --port "${SGLANG_PORT:-30000}"
  --disaggregation-mode "$mode"
  --disaggregation-transfer-backend mooncake
  --enable-metrics
)
case "$mode" in
  prefill) args+=(--disaggregation-bootstrap-port "${SGLANG_BOOTSTRAP_PORT:-8998}") ;;
  # Each stream chunk carries what it adds, not the whole output so far (docs/operations.md).
  decode) args+=(--incremental-streaming-output) ;;
  *) echo "isogate-engine: SGLANG_DISAGGREGATION_MODE must be prefill or decode, got '$mode'" >&2; exit 2 ;;
esac
[ -n "${SGLANG_SERVED_MODEL_NAME:-}" ] && args+=(--served-model-name "$SGLANG_SERVED_MODEL_NAME")
[ -n "${SGLANG_LOAD_FORMAT:-}" ] && args+=(--load-format "$SGLANG_LOAD_FORMAT")
[ -n "${SGLANG_CONTEXT_LENGTH:-}" ] && args+=(--context-length "$SGLANG_CONTEXT_LENGTH")
[ -n "${SGLANG_MAX_TOTAL_TOKENS:-}" ] && args+=(--max-total-tokens "$SGLANG_MAX_TOTAL_TOKENS")
[ -n "${SGLANG_MEM_FRACTION_STATIC:-}" ] && args+=(--mem-fraction-static "$SGLANG_MEM_FRACTION_STATIC")
[ -n "${SGLANG_TP_SIZE:-}" ] && args+=(--tp-size "$SGLANG_TP_SIZE")
[ -n "${SGLANG_IB_DEVICE:-}" ] && args+=(--disaggregation-ib-device "$SGLANG_IB_DEVICE")
# shellcheck disable=SC2206  # word splitting of the extra arguments is the point
[ -n "${SGLANG_EXTRA_ARGS:-}" ] && args+=($SGLANG_EXTRA_ARGS)

echo "isogate-engine: python3 -m sglang.launch_server ${args[*]} $*" >&2
exec python3 -m sglang.launch_server "${args[@]}" "$@"
