#!/usr/bin/env bash
# Smoke test of the container deployment, run on this machine (CPU only, loopback only):
#   1. builds the CPU image gpt-serve:cpu from ./Dockerfile -- torch from a local CPU wheel when one
#      exists (served to the build on 127.0.0.1, see TORCH_WHEEL below), else from the PyTorch index;
#   2. brings up the compose stack (project "gpt-smoke"): app-cpu + prometheus, and grafana when its
#      image is available locally;
#   3. waits (bounded) for the app to be healthy, then checks POST /generate (JSON with
#      generated_text) and POST /generate_stream (SSE `data:` events) on 127.0.0.1:$SMOKE_APP_PORT,
#      and that Prometheus reports the app target "up" (and Grafana, when running, is healthy and has
#      the provisioned dashboard);
#   4. always tears the stack down again (containers, network, the smoke project's volumes).
# Optional replicas stage (--replicas: after the steps above; --replicas-only: instead of 2.-3.):
#   5. brings up the compose profile `replicas` as project "gpt-smoke-replicas": nginx balancer `lb` in front
#      of 3 CPU replicas app-1..3 (same gpt-serve:cpu image) + Prometheus with
#      PROMETHEUS_CONFIG=./deploy/replicas/prometheus.yml;
#   6. waits (bounded) for all three replicas to be healthy and for the balancer to answer (GET /nginx-health
#      and GET /health through it), checks POST /generate and POST /generate_stream (complete SSE stream)
#      through the balancer's published port 127.0.0.1:$LB_PORT, and that Prometheus reports all three
#      replica targets (job gpt-serve, replica app-1/app-2/app-3) up;
#   7. tears that stack down too (docker compose down -v for project gpt-smoke-replicas).
# Exits non-zero on any failure. Needs: docker (engine + CLI), docker compose v2 or docker-compose
# v1.28+, curl, python3. Without Docker Hub, run scripts/docker-standin.sh once first.
#
# Environment knobs:
#   TORCH_WHEEL            local torch CPU wheel (default /opt/wheels/torch-2.13.0+cpu-cp311-cp311-
#                          manylinux_2_28_x86_64.whl); if it does not exist, torch comes from
#                          https://download.pytorch.org/whl/cpu
#   SMOKE_PYPI_INDEX       index for torch's own dependencies when TORCH_WHEEL is used (https://pypi.org/simple)
#   SMOKE_WHEEL_PORT       loopback port the wheel is served on during the build (18765)
#   SMOKE_APP_PORT / SMOKE_PROMETHEUS_PORT / SMOKE_GRAFANA_PORT   host ports (8000 / 9090 / 3000)
#   SMOKE_HEALTH_TIMEOUT   seconds to wait for a healthy app (240)
#   SMOKE_SKIP_BUILD=1     reuse an existing gpt-serve:cpu image
#   COMPOSE                compose command to use, e.g. "docker-compose" (default: docker compose v2 if
#                          present, else docker-compose)
#   SMOKE_REPLICAS         1 = same as --replicas, only = same as --replicas-only (default: unset, no replicas stage)
#   SMOKE_LB_PORT          host port of the balancer in the replicas stage (default: $LB_PORT, else 8080)
#   SMOKE_REPLICAS_HEALTH_TIMEOUT  seconds to wait for the three replicas to be healthy (default: 2x SMOKE_HEALTH_TIMEOUT)
#   NGINX_IMAGE            balancer image (default nginx:1.27-alpine; scripts/docker-standin.sh builds a stand-in)
#   REPLICA_TORCH_THREADS  CPU threads per replica (compose default 2)
#
# Usage: scripts/docker-smoke.sh [--replicas | --replicas-only]
set -euo pipefail

usage() { sed -n '2,/^set -euo pipefail/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'; }
run_default=1
run_replicas=0
case "${SMOKE_REPLICAS:-}" in
    "" | 0) ;;
    1) run_replicas=1 ;;
    only) run_default=0; run_replicas=1 ;;
    *) echo "SMOKE_REPLICAS must be 1 or only, not '${SMOKE_REPLICAS}'" >&2; exit 2 ;;
esac
for arg in "$@"; do
    case "$arg" in
        --replicas) run_replicas=1 ;;
        --replicas-only) run_default=0; run_replicas=1 ;;
        -h | --help) usage; exit 0 ;;
        *) echo "unknown argument: $arg (see --help)" >&2; exit 2 ;;
    esac
done

start_ts=$SECONDS
cd "$(dirname "${BASH_SOURCE[0]}")/.."

log() { printf '[smoke %4ss] %s\n' "$((SECONDS - start_ts))" "$*"; }
fail() { printf '[smoke %4ss] FAIL: %s\n' "$((SECONDS - start_ts))" "$*" >&2; exit 1; }

TORCH_WHEEL=${TORCH_WHEEL:-/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl}
SMOKE_PYPI_INDEX=${SMOKE_PYPI_INDEX:-https://pypi.org/simple}
HEALTH_TIMEOUT=${SMOKE_HEALTH_TIMEOUT:-240}
IMAGE=gpt-serve:cpu
PROJECT=gpt-smoke
REPLICAS_PROJECT=gpt-smoke-replicas
REPLICAS_HEALTH_TIMEOUT=${SMOKE_REPLICAS_HEALTH_TIMEOUT:-$((2 * HEALTH_TIMEOUT))}
REPLICAS=(app-1 app-2 app-3)

# Published ports: loopback only.
export BIND_ADDR=127.0.0.1
export APP_PORT=${SMOKE_APP_PORT:-8000}
export PROMETHEUS_PORT=${SMOKE_PROMETHEUS_PORT:-9090}
export GRAFANA_PORT=${SMOKE_GRAFANA_PORT:-3000}
export LB_PORT=${SMOKE_LB_PORT:-${LB_PORT:-8080}}
# The smoke requests send no credentials: make sure the container does not get an API key.
unset GPT_API_KEY GPT_CHECKPOINT GPT_DEVICE GPT_DTYPE || true
PROMETHEUS_IMAGE=${PROMETHEUS_IMAGE:-prom/prometheus:latest}
GRAFANA_IMAGE=${GRAFANA_IMAGE:-grafana/grafana:latest}
NGINX_IMAGE=${NGINX_IMAGE:-nginx:1.27-alpine}
export PROMETHEUS_IMAGE GRAFANA_IMAGE NGINX_IMAGE

APP_URL="http://127.0.0.1:${APP_PORT}"
PROM_URL="http://127.0.0.1:${PROMETHEUS_PORT}"
GRAFANA_URL="http://127.0.0.1:${GRAFANA_PORT}"
LB_URL="http://127.0.0.1:${LB_PORT}"

# ---------------------------------------------------------------- preflight
command -v docker >/dev/null || fail "docker CLI not found"
command -v curl >/dev/null || fail "curl not found"
command -v python3 >/dev/null || fail "python3 not found"
docker info >/dev/null 2>&1 || fail "docker engine not reachable (is dockerd running? see scripts/docker-standin.sh)"

if [[ -n "${COMPOSE:-}" ]]; then
    read -r -a compose_cmd <<<"$COMPOSE"
elif docker compose version >/dev/null 2>&1; then
    compose_cmd=(docker compose)
elif command -v docker-compose >/dev/null; then
    compose_cmd=(docker-compose)
else
    fail "neither 'docker compose' nor 'docker-compose' is available"
fi
compose() { "${compose_cmd[@]}" -p "$PROJECT" -f docker-compose.yml --profile cpu "$@"; }
compose_replicas() {
    PROMETHEUS_CONFIG=./deploy/replicas/prometheus.yml \
        "${compose_cmd[@]}" -p "$REPLICAS_PROJECT" -f docker-compose.yml --profile replicas "$@"
}
log "compose: ${compose_cmd[*]} ($("${compose_cmd[@]}" version 2>/dev/null | sed -n 1p))"

port_in_use() { python3 -c 'import socket,sys; s=socket.socket(); s.settimeout(1); sys.exit(0 if s.connect_ex(("127.0.0.1", int(sys.argv[1]))) == 0 else 1)' "$1"; }
if [[ "$run_default" == 1 ]]; then
    for p in "$APP_PORT" "$PROMETHEUS_PORT"; do
        if port_in_use "$p"; then fail "127.0.0.1:$p is already in use (pick another with SMOKE_APP_PORT / SMOKE_PROMETHEUS_PORT)"; fi
    done
fi
if [[ "$run_replicas" == 1 ]]; then
    # (Prometheus's port is checked again when the stage starts: the default stage uses it until its teardown.)
    for p in "$LB_PORT" "$PROMETHEUS_PORT"; do
        if port_in_use "$p"; then fail "127.0.0.1:$p is already in use (pick another with SMOKE_LB_PORT / SMOKE_PROMETHEUS_PORT)"; fi
    done
    docker image inspect "$NGINX_IMAGE" >/dev/null 2>&1 \
        || fail "image $NGINX_IMAGE not found locally (no registry here? run scripts/docker-standin.sh)"
fi

docker image inspect "$PROMETHEUS_IMAGE" >/dev/null 2>&1 \
    || fail "image $PROMETHEUS_IMAGE not found locally (no registry here? run scripts/docker-standin.sh)"
services=(app-cpu prometheus)
with_grafana=0
if [[ "$run_default" == 1 ]]; then
    if docker image inspect "$GRAFANA_IMAGE" >/dev/null 2>&1; then
        if port_in_use "$GRAFANA_PORT"; then fail "127.0.0.1:$GRAFANA_PORT is already in use (SMOKE_GRAFANA_PORT)"; fi
        services+=(grafana)
        with_grafana=1
    else
        log "SKIP grafana: image $GRAFANA_IMAGE is not available locally"
    fi
fi

tmp=$(mktemp -d)
wheel_pid=""
stack_started=0
replicas_started=0
# Tears down one stack (only when this run started it); on failure shows its status and logs first.
# $1: exit status so far, $2: name of its "started" flag variable, $3: its compose function, $4: label
teardown_stack() {
    local rc=$1 flag=$2 cmd=$3 label=$4
    [[ "${!flag}" == 1 ]] || return 0
    if [[ "$rc" != 0 ]]; then
        log "--- $label: container status ---"
        "$cmd" ps
        log "--- $label: last log lines ---"
        "$cmd" logs --no-color --tail=60
    fi
    log "tearing down the $label stack"
    "$cmd" down -v --remove-orphans --timeout 30 >"$tmp/down-$label.log" 2>&1 \
        || { cat "$tmp/down-$label.log"; log "WARNING: compose down ($label) failed"; return 1; }
    printf -v "$flag" 0
}
teardown_default() { teardown_stack "$1" stack_started compose default; }
teardown_replicas() { teardown_stack "$1" replicas_started compose_replicas replicas; }
cleanup() {
    local rc=$?
    set +e
    if [[ -n "$wheel_pid" ]]; then kill "$wheel_pid" 2>/dev/null; wait "$wheel_pid" 2>/dev/null; fi
    teardown_default "$rc"
    teardown_replicas "$rc"
    rm -rf "$tmp"
    if [[ "$rc" == 0 ]]; then
        log "PASSED in $((SECONDS - start_ts))s"
    else
        log "FAILED (exit $rc) after $((SECONDS - start_ts))s"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---------------------------------------------------------------- build
if [[ "${SMOKE_SKIP_BUILD:-0}" == 1 ]]; then
    docker image inspect "$IMAGE" >/dev/null 2>&1 || fail "SMOKE_SKIP_BUILD=1 but image $IMAGE does not exist"
    log "reusing existing image $IMAGE"
else
    build_args=(--build-arg TORCH_VARIANT=cpu)
    if [[ -f "$TORCH_WHEEL" ]]; then
        # Serve just this wheel on loopback; the build runs on the host network so pip reaches it.
        wheel_name=$(basename "$TORCH_WHEEL")
        torch_version=$(cut -d- -f2 <<<"$wheel_name")   # torch-2.13.0+cpu-cp311-... -> 2.13.0+cpu
        mkdir -p "$tmp/wheels"
        ln -s "$(readlink -f "$TORCH_WHEEL")" "$tmp/wheels/$wheel_name"
        # A fixed port keeps the TORCH_FIND_LINKS build arg, and so the cached torch layer, stable
        # between runs; a random one (0) when that port is taken.
        wheel_port=${SMOKE_WHEEL_PORT:-18765}
        if port_in_use "$wheel_port"; then
            log "127.0.0.1:$wheel_port is taken: serving the wheel on a random port (torch layer cache will miss)"
            wheel_port=0
        fi
        python3 -u -m http.server "$wheel_port" --bind 127.0.0.1 --directory "$tmp/wheels" >"$tmp/wheel-server.log" 2>&1 &
        wheel_pid=$!
        wheel_port=""
        for _ in $(seq 1 50); do
            wheel_port=$(sed -n 's/^Serving HTTP on 127\.0\.0\.1 port \([0-9]*\).*/\1/p' "$tmp/wheel-server.log")
            [[ -n "$wheel_port" ]] && break
            kill -0 "$wheel_pid" 2>/dev/null || break
            sleep 0.1
        done
        [[ -n "$wheel_port" ]] || { cat "$tmp/wheel-server.log" >&2; fail "local wheel server did not start"; }
        log "serving $wheel_name on 127.0.0.1:$wheel_port for the build"
        build_args+=(--network host
            --build-arg "TORCH_VERSION=$torch_version"
            --build-arg "TORCH_INDEX_URL=$SMOKE_PYPI_INDEX"
            --build-arg "TORCH_FIND_LINKS=http://127.0.0.1:$wheel_port/")
    else
        log "no local wheel at $TORCH_WHEEL: torch comes from https://download.pytorch.org/whl/cpu"
    fi
    log "building $IMAGE"
    build_start=$SECONDS
    if ! docker build "${build_args[@]}" -t "$IMAGE" . >"$tmp/build.log" 2>&1; then
        tail -n 60 "$tmp/build.log" >&2
        fail "docker build failed"
    fi
    log "built $IMAGE in $((SECONDS - build_start))s ($(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))"
    if [[ -n "$wheel_pid" ]]; then kill "$wheel_pid" 2>/dev/null || true; wait "$wheel_pid" 2>/dev/null || true; wheel_pid=""; fi
fi

# ---------------------------------------------------------------- check helpers (both stages)
payload='{"inputs":"ROMEO:","parameters":{"max_new_tokens":20}}'

# wait_healthy TIMEOUT COMPOSE_FN SERVICE...: waits until every service's container is running and healthy;
# fails at once when one exits, restarts or turns unhealthy, or when TIMEOUT seconds pass.
wait_healthy() {
    local timeout=$1 fn=$2 svc cid info state health restarts deadline pending
    shift 2
    local -A cids=()
    for svc in "$@"; do
        cid=$("$fn" ps -q "$svc")
        [[ -n "$cid" ]] || fail "no container for service $svc"
        cids[$svc]=$cid
    done
    deadline=$((SECONDS + timeout))
    while :; do
        pending=()
        for svc in "$@"; do
            cid=${cids[$svc]}
            info=$(docker inspect -f '{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}} {{.RestartCount}}' "$cid" 2>/dev/null) \
                || fail "$svc container $cid disappeared"
            read -r state health restarts <<<"$info"
            if [[ "$state" == running && "$health" == healthy ]]; then continue; fi
            if [[ "$state" == exited || "$state" == dead || "$restarts" != 0 ]]; then
                fail "$svc container stopped (state=$state, restarts=$restarts) before becoming healthy"
            fi
            if [[ "$health" == unhealthy ]]; then fail "$svc is unhealthy (GET /health inside the container failed)"; fi
            pending+=("$svc(state=$state health=$health)")
        done
        ((${#pending[@]} == 0)) && return 0
        if ((SECONDS >= deadline)); then
            fail "not healthy after ${timeout}s: ${pending[*]}"
        fi
        sleep 2
    done
}

# check_generate BASE_URL: POST /generate answers 200 with a non-empty generated_text.
check_generate() {
    local base=$1 code
    log "POST /generate"
    curl -sS --max-time 120 -o "$tmp/generate.json" -w '%{http_code}' \
        -H 'Content-Type: application/json' -d "$payload" "$base/generate" >"$tmp/generate.code" \
        || fail "POST /generate: request failed"
    code=$(cat "$tmp/generate.code")
    [[ "$code" == 200 ]] || fail "POST /generate: HTTP $code: $(head -c 500 "$tmp/generate.json")"
    python3 - "$tmp/generate.json" <<'EOF' || fail "POST /generate: unexpected answer: $(head -c 500 "$tmp/generate.json")"
import json, sys
d = json.load(open(sys.argv[1]))
text = d["generated_text"]
assert isinstance(text, str) and text, "generated_text empty or not a string"
print("  generated_text:", repr(text[:120]))
EOF
}

# check_stream BASE_URL: POST /generate_stream answers 200 with SSE `data:` events.
check_stream() {
    local base=$1 code events
    log "POST /generate_stream"
    curl -sS -N --max-time 120 -o "$tmp/stream.txt" -w '%{http_code}' \
        -H 'Content-Type: application/json' -H 'Accept: text/event-stream' -d "$payload" \
        "$base/generate_stream" >"$tmp/stream.code" || fail "POST /generate_stream: request failed"
    code=$(cat "$tmp/stream.code")
    [[ "$code" == 200 ]] || fail "POST /generate_stream: HTTP $code: $(head -c 500 "$tmp/stream.txt")"
    events=$(grep -c '^data:' "$tmp/stream.txt" || true)
    ((events > 0)) || fail "POST /generate_stream: no 'data:' events in: $(head -c 500 "$tmp/stream.txt")"
    log "  $events SSE data events; last: $(grep '^data:' "$tmp/stream.txt" | tail -n1 | head -c 200)"
}

# ---------------------------------------------------------------- replicas stage (optional)
# Profile `replicas`: lb (nginx) + app-1..3 (CPU) + Prometheus scraping each replica, as its own compose project.
replicas_stage() {
    local stage_start=$SECONDS deadline
    log "=== replicas stage: lb + ${REPLICAS[*]} + prometheus (project $REPLICAS_PROJECT, balancer on $LB_URL)"
    for p in "$LB_PORT" "$PROMETHEUS_PORT"; do
        if port_in_use "$p"; then fail "127.0.0.1:$p is already in use (pick another with SMOKE_LB_PORT / SMOKE_PROMETHEUS_PORT)"; fi
    done
    # shellcheck disable=SC2034  # read through teardown_stack's indirect ${!flag}
    replicas_started=1
    compose_replicas up -d --no-build lb prometheus

    log "waiting up to ${REPLICAS_HEALTH_TIMEOUT}s for ${REPLICAS[*]} and lb to become healthy"
    wait_healthy "$REPLICAS_HEALTH_TIMEOUT" compose_replicas "${REPLICAS[@]}" lb
    log "${REPLICAS[*]} and lb are healthy ($((SECONDS - stage_start))s after up)"

    # The balancer itself, then a replica's readiness through it.
    deadline=$((SECONDS + 60))
    until curl -fsS --max-time 5 "$LB_URL/nginx-health" -o /dev/null 2>/dev/null \
        && curl -fsS --max-time 10 "$LB_URL/health" -o /dev/null 2>/dev/null; do
        ((SECONDS < deadline)) || fail "balancer on $LB_URL does not answer GET /nginx-health and GET /health"
        sleep 2
    done
    log "balancer answers on $LB_URL (GET /nginx-health, GET /health through it)"

    check_generate "$LB_URL"
    check_stream "$LB_URL"
    # Through the balancer the stream must arrive whole: the last token event carries the generated text.
    python3 - "$tmp/stream.txt" <<'EOF' || fail "POST /generate_stream through the balancer: stream incomplete: $(tail -c 500 "$tmp/stream.txt")"
import json, sys
events = [line[5:].strip() for line in open(sys.argv[1]) if line.startswith("data:")]
events = [json.loads(e) for e in events if e and e != "[DONE]"]
assert events, "no JSON events"
assert not any("error" in e for e in events), "error event in the stream"
last = events[-1]
assert isinstance(last.get("generated_text"), str) and last["generated_text"], "last event has no generated_text"
print("  stream complete:", len(events), "token events; generated_text:", repr(last["generated_text"][:80]))
EOF

    # A few more requests, so that every replica serves some (least_conn spreads idle ties round-robin).
    local i
    for i in 1 2 3 4 5 6; do
        curl -fsS --max-time 120 -o /dev/null -H 'Content-Type: application/json' \
            -d '{"inputs":"JULIET:","parameters":{"max_new_tokens":4}}' "$LB_URL/generate" \
            || fail "POST /generate #$i through the balancer failed"
    done
    local upstreams sent_at
    sent_at=$(date +%s)
    upstreams=$(compose_replicas logs --no-color lb 2>/dev/null | grep -o 'upstream=[0-9.]*:8000' | sort | uniq -c | awk '{printf " %s=%s", substr($2, 10), $1}')
    log "  lb access log, requests per upstream:${upstreams:- (none found)}"

    log "waiting for Prometheus to scrape all replicas (job gpt-serve, ${REPLICAS[*]} up)"
    deadline=$((SECONDS + 90))
    while :; do
        if curl -fsS --max-time 5 "$PROM_URL/api/v1/targets" -o "$tmp/targets.json" 2>/dev/null \
            && python3 - "$tmp/targets.json" "${REPLICAS[@]}" <<'EOF'; then break; fi
import json, sys
want = set(sys.argv[2:])
targets = json.load(open(sys.argv[1]))["data"]["activeTargets"]
up = {t["labels"].get("replica") for t in targets
      if t["labels"].get("job") == "gpt-serve" and t["health"] == "up"}
sys.exit(0 if want <= up else 1)
EOF
        if ((SECONDS >= deadline)); then
            fail "Prometheus does not report all replica targets up: $(head -c 1200 "$tmp/targets.json" 2>/dev/null)"
        fi
        sleep 3
    done
    python3 - "$tmp/targets.json" <<'EOF'
import json, sys
for t in json.load(open(sys.argv[1]))["data"]["activeTargets"]:
    if t["labels"].get("job") == "gpt-serve":
        print(f"  target {t['labels'].get('replica')} ({t['scrapeUrl']}): {t['health']}")
EOF
    log "Prometheus: all ${#REPLICAS[@]} replica targets are up"
    # the counts are read from a scrape made after the requests above (every replica's sample newer than them);
    # reading at once showed the scrape before them (app-1=0, app-2=0 although each had served)
    log "waiting for a scrape of every replica newer than the last request (sent at $sent_at)"
    deadline=$((SECONDS + 60))
    until curl -fsS --max-time 5 "$PROM_URL/api/v1/query" \
            --data-urlencode 'query=min(timestamp(gpt_generated_tokens_total{job="gpt-serve"}))' -o "$tmp/ts.json" \
        && python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))["data"]["result"]; sys.exit(0 if r and float(r[0]["value"][1]) > float(sys.argv[2]) else 1)' \
            "$tmp/ts.json" "$sent_at"; do
        if ((SECONDS >= deadline)); then
            fail "no scrape of every replica after the requests within 60 s: $(head -c 300 "$tmp/ts.json" 2>/dev/null)"
        fi
        sleep 2
    done
    if curl -fsS --max-time 5 "$PROM_URL/api/v1/query" --data-urlencode 'query=sum by (replica) (gpt_generated_tokens_total)' \
        -o "$tmp/query.json"; then
        log "  gpt_generated_tokens_total by replica (latest scrape): $(python3 -c 'import json,sys; print(", ".join(r["metric"].get("replica","?") + "=" + r["value"][1] for r in json.load(open(sys.argv[1]))["data"]["result"]))' "$tmp/query.json" 2>/dev/null || head -c 300 "$tmp/query.json")"
    fi

    teardown_replicas 0 || fail "could not tear down the replicas stack"
    log "=== replicas stage passed in $((SECONDS - stage_start))s"
}

if [[ "$run_default" == 0 ]]; then
    replicas_stage
    log "all checks passed"
    exit 0
fi

# ---------------------------------------------------------------- up
log "starting: ${services[*]}"
# shellcheck disable=SC2034  # read through teardown_stack's indirect ${!flag}
stack_started=1
compose up -d --no-build "${services[@]}"

log "waiting up to ${HEALTH_TIMEOUT}s for app-cpu to become healthy"
wait_healthy "$HEALTH_TIMEOUT" compose app-cpu
log "app-cpu is healthy"
curl -fsS --max-time 10 "$APP_URL/health" >/dev/null || fail "GET $APP_URL/health failed through the published port"

# ---------------------------------------------------------------- API checks
check_generate "$APP_URL"
check_stream "$APP_URL"

# ---------------------------------------------------------------- Prometheus
log "waiting for Prometheus to scrape the app (job gpt-serve, health up)"
deadline=$((SECONDS + 90))
while :; do
    if curl -fsS --max-time 5 "$PROM_URL/api/v1/targets" -o "$tmp/targets.json" 2>/dev/null \
        && python3 - "$tmp/targets.json" <<'EOF'; then break; fi
import json, sys
targets = json.load(open(sys.argv[1]))["data"]["activeTargets"]
app = [t for t in targets if t["labels"].get("job") == "gpt-serve"]
sys.exit(0 if app and all(t["health"] == "up" for t in app) else 1)
EOF
    if ((SECONDS >= deadline)); then
        fail "Prometheus does not report the app target up: $(head -c 800 "$tmp/targets.json" 2>/dev/null)"
    fi
    sleep 3
done
log "Prometheus: target app:8000 is up"
if curl -fsS --max-time 5 "$PROM_URL/api/v1/query?query=gpt_generated_tokens_total" -o "$tmp/query.json"; then
    log "  gpt_generated_tokens_total: $(head -c 300 "$tmp/query.json")"
else
    log "  (could not query gpt_generated_tokens_total)"
fi

# ---------------------------------------------------------------- Grafana (optional)
if [[ "$with_grafana" == 1 ]]; then
    log "waiting for Grafana"
    deadline=$((SECONDS + 120))
    until curl -fsS --max-time 5 "$GRAFANA_URL/api/health" -o /dev/null 2>/dev/null; do
        ((SECONDS < deadline)) || fail "Grafana not healthy after 120s"
        sleep 3
    done
    curl -fsS --max-time 10 "$GRAFANA_URL/api/search?query=GPT" -o "$tmp/search.json" \
        || fail "Grafana dashboard search failed"
    grep -q '"uid":"gpt-serve"' "$tmp/search.json" || fail "Grafana: dashboard gpt-serve not provisioned: $(head -c 500 "$tmp/search.json")"
    log "Grafana: healthy, dashboard gpt-serve provisioned"
fi


if [[ "$run_replicas" == 1 ]]; then
    # One stack at a time: both publish Prometheus's port.
    teardown_default 0 || fail "could not tear down the default stack before the replicas stage"
    replicas_stage
fi

log "all checks passed"
