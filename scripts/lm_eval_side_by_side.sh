#!/usr/bin/env bash
# lm-evaluation-harness against `hetero-pd serve` (its `local-completions` model) and against
# transformers (its `hf` model), same model, float32 both sides, same two tasks built from
# local JSONL files in scripts/lm_eval/: hpd_mc (multiple choice, log-likelihood: needs the
# completions API's `logprobs` + `echo`) and hpd_gen (generate_until, greedy).  The scores
# must agree within noise; the per-question answers are compared too.
#
# Not run in CI, and lm_eval is not a dependency of hetero-pd.  Install it apart, e.g. into a
# folder of its own next to the project's virtual environment (only the packages it lacks):
#
#   .venv/bin/pip install --target /tmp/lmeval-deps "lm_eval[api]==0.4.13"
#   # then copy into /tmp/lmeval-pkgs only the packages .venv lacks (lm_eval, datasets,
#   # evaluate, pandas, pyarrow, scikit-learn, scipy, sacrebleu, tenacity, ... : import
#   # lm_eval.models.openai_completions to check), so torch's numpy & co. stay the venv's
#   LM_EVAL="env PYTHONPATH=/tmp/lmeval-pkgs:$PWD .venv/bin/python -m lm_eval" \
#     scripts/lm_eval_side_by_side.sh
#
#   scripts/lm_eval_side_by_side.sh --limit 10 --tasks hpd_mc     # a quicker look
#
# It starts `hetero-pd serve MODEL --port <free port> --api-key <random> --dtype float32` in
# a process group of its own, waits for /health, runs both harnesses one after the other
# (batch size 1, --log_samples), stops the server it started, and prints, last, one JSON
# line: both sides' metrics per task and how many questions the two sides answered
# differently.  Results and logs go to --out.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL="smollm2-135m-instruct"
TASKS="hpd_mc,hpd_gen"
LIMIT=""
OUT="${REPO}/bench_results/lm-eval-$(date -u +%Y%m%dT%H%M%SZ)"
START_TIMEOUT=900
HPD_PY="${HPD_PY:-${REPO}/.venv/bin/python}"

usage() {
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  cat <<USAGE

Options (defaults in brackets):
  --model M            what 'hetero-pd serve' takes: a known name or a model folder [$MODEL]
  --tasks LIST         comma-separated, from scripts/lm_eval/ [$TASKS]
  --limit N            at most N questions per task [all]
  --out DIR            results and logs [bench_results/lm-eval-<UTC time>]
  --start-timeout S    seconds to wait for the server's /health [$START_TIMEOUT]
Environment: HPD_PY (hetero-pd's python) [${REPO}/.venv/bin/python],
  LM_EVAL (how to run lm_eval's CLI) [\$HPD_PY -m lm_eval].
USAGE
}

while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    --tasks) TASKS="$2"; shift 2 ;;
    --limit) LIMIT="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --start-timeout) START_TIMEOUT="$2"; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "unknown option: $1 (see --help)" >&2; exit 2 ;;
  esac
done

die() { echo "lm_eval_side_by_side: $*" >&2; exit 1; }
log() { echo "lm_eval_side_by_side: $*" >&2; }
[[ -z "$LIMIT" || "$LIMIT" =~ ^[1-9][0-9]*$ ]] || die "--limit must be a positive integer"
command -v curl >/dev/null || die "curl not found"
read -r -a LM_EVAL_CMD <<<"${LM_EVAL:-$HPD_PY -m lm_eval}"
"${LM_EVAL_CMD[@]}" --help >/dev/null 2>&1 ||
  die "cannot run lm_eval as '${LM_EVAL_CMD[*]}' (install it: see the header of $0; set LM_EVAL)"
mkdir -p "$OUT"
cd "$REPO"  # the tasks' data_files are relative to the repository root

# The folder behind MODEL (the tokenizer of local-completions, the weights of hf).
MODEL_DIR="$(PYTHONPATH="${REPO}${PYTHONPATH:+:$PYTHONPATH}" "$HPD_PY" -c \
  'import sys; from hetero_pd.models.fetch import resolve_model; print(resolve_model(sys.argv[1]))' \
  "$MODEL")"
log "model ${MODEL}: ${MODEL_DIR}"

# shellcheck source=scripts/servers.sh
source "${REPO}/scripts/servers.sh"  # SERVER_PIDS, stop_servers, free_port, wait_healthy
PORT="$(free_port)"
API_KEY="$("$HPD_PY" -c 'import secrets; print(secrets.token_hex(16))')"
URL="http://127.0.0.1:${PORT}"
log "starting hetero-pd serve ${MODEL} at ${URL} (log: ${OUT}/server.log)"
HETERO_PD_API_KEY="" PYTHONPATH="${REPO}${PYTHONPATH:+:$PYTHONPATH}" setsid "$HPD_PY" \
  -m hetero_pd.cli serve "$MODEL" --host 127.0.0.1 --port "$PORT" --api-key "$API_KEY" \
  --dtype float32 --served-model-name "$MODEL" >"${OUT}/server.log" 2>&1 &
SERVER_PIDS+=("$!")
wait_healthy "$URL" "$!" "${OUT}/server.log"

COMMON=(--include_path "${REPO}/scripts/lm_eval" --tasks "$TASKS" --batch_size 1 --log_samples)
[[ -z "$LIMIT" ]] || COMMON+=(--limit "$LIMIT")
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

log "lm_eval local-completions against ${URL}"
OPENAI_API_KEY="$API_KEY" "${LM_EVAL_CMD[@]}" --model local-completions \
  --model_args "model=${MODEL},base_url=${URL}/v1/completions,tokenizer_backend=huggingface,tokenizer=${MODEL_DIR},num_concurrent=1,max_retries=1" \
  "${COMMON[@]}" --output_path "${OUT}/hetero-pd" >"${OUT}/hetero-pd.log" 2>&1 ||
  { tail -n 40 "${OUT}/hetero-pd.log" >&2; die "lm_eval local-completions failed; log: ${OUT}/hetero-pd.log"; }
stop_servers  # free the CPUs for transformers

log "lm_eval hf (transformers, float32)"
"${LM_EVAL_CMD[@]}" --model hf --model_args "pretrained=${MODEL_DIR},dtype=float32" --device cpu \
  "${COMMON[@]}" --output_path "${OUT}/hf" >"${OUT}/hf.log" 2>&1 ||
  { tail -n 40 "${OUT}/hf.log" >&2; die "lm_eval hf failed; log: ${OUT}/hf.log"; }

grep -h -A8 '^| *Tasks' "${OUT}/hetero-pd.log" "${OUT}/hf.log" >&2 || true
"$HPD_PY" "${REPO}/scripts/lm_eval/compare.py" "${OUT}/hetero-pd" "${OUT}/hf" | tee "${OUT}/scores.json"
