# Shell helpers shared by the side-by-side scripts (sourced, not run): servers started as
# process groups of their own (setsid ... &), appended to SERVER_PIDS, stopped by
# stop_servers (TERM to the group, 30 s, then KILL), whatever happens.  Needs HPD_PY (a
# python), START_TIMEOUT (seconds) and a die function.
SERVER_PIDS=()
stop_servers() {
  local pid
  for pid in "${SERVER_PIDS[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
      kill -KILL -- "-$pid" 2>/dev/null || true
    fi
  done
  SERVER_PIDS=()
}
trap stop_servers EXIT
trap 'stop_servers; exit 130' INT TERM

free_port() {
  "$HPD_PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

wait_healthy() {  # URL PID LOG
  local url="$1" pid="$2" logfile="$3" waited=0
  until curl -sf -o /dev/null "${url}/health"; do
    kill -0 "$pid" 2>/dev/null || { tail -n 40 "$logfile" >&2; die "server exited; log: $logfile"; }
    ((waited >= START_TIMEOUT)) && { tail -n 40 "$logfile" >&2; die "no /health at $url after ${START_TIMEOUT}s"; }
    sleep 2
    waited=$((waited + 2))
  done
}
