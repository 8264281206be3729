#!/usr/bin/env bash
# Run a command (default: the test suite, `make test`) while another EPD stack on this machine serves load, as
# as a shared machine demands: the suite must pass beside other programs' processes, ports and shared-memory segments.
#   epd_bench/busy_suite.sh [COMMAND...]          e.g. epd_bench/busy_suite.sh .ci/run
# The load: the launcher on the demo model (1 encoder, 1 decoder; its own ports) and epd-bench rounds against it
# (image requests, Poisson arrivals at LOAD_RATE/s, up to LOAD_CONCURRENCY in flight), until the command ends.
# Writes runs/busy-suite/{stack.log,load.log}; prints the command's status and every load round's summary.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=runs/busy-suite
PORT=${LOAD_PORT:-18765}
RATE=${LOAD_RATE:-2}
CONC=${LOAD_CONCURRENCY:-4}
mkdir -p "$OUT"
make install >/dev/null
.venv/bin/disagg-epd-proxy --model demo --num-encoders 1 --num-decoders 1 --port "$PORT" >"$OUT/stack.log" 2>&1 &
stack=$!
until curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null; do
  kill -0 "$stack" 2>/dev/null || { echo "the load stack died:"; tail -20 "$OUT/stack.log"; exit 1; }
  sleep 1
done
(
  round=0
  while true; do
    round=$((round + 1))
    echo "== round $round $(date -u +%T)"
    .venv/bin/epd-bench --base-url "http://127.0.0.1:$PORT" --model demo --num-prompts 100 --images-per-request 1 \
      --image-size 64 --repeat-ratio 0.3 --random-output-len 16 --request-rate "$RATE" --max-concurrency "$CONC" \
      --seed "$round" --disable-tqdm 2>&1 | grep -E "Successful|Failed|Mean TTFT|Request throughput" || true
  done
) >"$OUT/load.log" 2>&1 &
load=$!
start=$(date +%s)
if [ $# -gt 0 ]; then "$@"; else make test; fi
status=$?
end=$(date +%s)
kill "$load" 2>/dev/null; pkill -P "$load" 2>/dev/null
kill "$stack"; wait "$stack" 2>/dev/null
echo "command status $status after $((end - start)) s beside the load; load rounds:"
cat "$OUT/load.log"
exit $status
