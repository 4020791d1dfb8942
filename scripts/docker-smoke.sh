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
set -euo pipefail

start_ts=$SECONDS
cd "$(dirname "${BASH_SOURCE[0]}")/.."

log() { printf '[smoke %4ss] %s\n' "$((SECONDS - start_ts))" "$*"; }
fail() { printf '[smoke %4ss] FAIL: %s\n' "$((SECONDS - start_ts))" "$*" >&2; exit 1; }

TORCH_WHEEL=${TORCH_WHEEL:-/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl}
SMOKE_PYPI_INDEX=${SMOKE_PYPI_INDEX:-https://pypi.org/simple}
HEALTH_TIMEOUT=${SMOKE_HEALTH_TIMEOUT:-240}
IMAGE=gpt-serve:cpu
PROJECT=gpt-smoke

# Published ports: loopback only.
export BIND_ADDR=127.0.0.1
export APP_PORT=${SMOKE_APP_PORT:-8000}
export PROMETHEUS_PORT=${SMOKE_PROMETHEUS_PORT:-9090}
export GRAFANA_PORT=${SMOKE_GRAFANA_PORT:-3000}
# The smoke requests send no credentials: make sure the container does not get an API key.
unset GPT_API_KEY GPT_CHECKPOINT GPT_DEVICE GPT_DTYPE || true
PROMETHEUS_IMAGE=${PROMETHEUS_IMAGE:-prom/prometheus:latest}
GRAFANA_IMAGE=${GRAFANA_IMAGE:-grafana/grafana:latest}
export PROMETHEUS_IMAGE GRAFANA_IMAGE

APP_URL="http://127.0.0.1:${APP_PORT}"
PROM_URL="http://127.0.0.1:${PROMETHEUS_PORT}"
GRAFANA_URL="http://127.0.0.1:${GRAFANA_PORT}"

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
log "compose: ${compose_cmd[*]} ($("${compose_cmd[@]}" version 2>/dev/null | head -n1))"

port_in_use() { python3 -c 'import socket,sys; s=socket.socket(); s.settimeout(1); sys.exit(0 if s.connect_ex(("127.0.0.1", int(sys.argv[1]))) == 0 else 1)' "$1"; }
for p in "$APP_PORT" "$PROMETHEUS_PORT"; do
    if port_in_use "$p"; then fail "127.0.0.1:$p is already in use (pick another with SMOKE_APP_PORT / SMOKE_PROMETHEUS_PORT)"; fi
done

docker image inspect "$PROMETHEUS_IMAGE" >/dev/null 2>&1 \
    || fail "image $PROMETHEUS_IMAGE not found locally (no registry here? run scripts/docker-standin.sh)"
services=(app-cpu prometheus)
with_grafana=0
if docker image inspect "$GRAFANA_IMAGE" >/dev/null 2>&1; then
    if port_in_use "$GRAFANA_PORT"; then fail "127.0.0.1:$GRAFANA_PORT is already in use (SMOKE_GRAFANA_PORT)"; fi
    services+=(grafana)
    with_grafana=1
else
    log "SKIP grafana: image $GRAFANA_IMAGE is not available locally"
fi

tmp=$(mktemp -d)
wheel_pid=""
stack_started=0
cleanup() {
    local rc=$?
    set +e
    if [[ -n "$wheel_pid" ]]; then kill "$wheel_pid" 2>/dev/null; wait "$wheel_pid" 2>/dev/null; fi
    if [[ "$stack_started" == 1 ]]; then
        if [[ "$rc" != 0 ]]; then
            log "--- container status ---"
            compose ps
            log "--- last log lines ---"
            compose logs --no-color --tail=80
        fi
        log "tearing down the stack"
        compose down -v --remove-orphans --timeout 30 >"$tmp/down.log" 2>&1 \
            || { cat "$tmp/down.log"; log "WARNING: compose down failed"; }
    fi
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

# ---------------------------------------------------------------- up
log "starting: ${services[*]}"
stack_started=1
compose up -d --no-build "${services[@]}"

cid=$(compose ps -q app-cpu)
[[ -n "$cid" ]] || fail "no container for service app-cpu"

log "waiting up to ${HEALTH_TIMEOUT}s for app-cpu to become healthy"
deadline=$((SECONDS + HEALTH_TIMEOUT))
while :; do
    info=$(docker inspect -f '{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}} {{.RestartCount}}' "$cid" 2>/dev/null) \
        || fail "app-cpu container $cid disappeared"
    read -r state health restarts <<<"$info"
    if [[ "$state" == running && "$health" == healthy ]]; then break; fi
    if [[ "$state" == exited || "$state" == dead || "$restarts" != 0 ]]; then
        fail "app-cpu container stopped (state=$state, restarts=$restarts) before becoming healthy"
    fi
    if [[ "$health" == unhealthy ]]; then fail "app-cpu is unhealthy (GET /health inside the container failed)"; fi
    if ((SECONDS >= deadline)); then
        fail "app-cpu not healthy after ${HEALTH_TIMEOUT}s (state=$state health=$health)"
    fi
    sleep 2
done
log "app-cpu is healthy"
curl -fsS --max-time 10 "$APP_URL/health" >/dev/null || fail "GET $APP_URL/health failed through the published port"

# ---------------------------------------------------------------- API checks
payload='{"inputs":"ROMEO:","parameters":{"max_new_tokens":20}}'

log "POST /generate"
curl -sS --max-time 120 -o "$tmp/generate.json" -w '%{http_code}' \
    -H 'Content-Type: application/json' -d "$payload" "$APP_URL/generate" >"$tmp/generate.code" \
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

log "POST /generate_stream"
curl -sS -N --max-time 120 -o "$tmp/stream.txt" -w '%{http_code}' \
    -H 'Content-Type: application/json' -H 'Accept: text/event-stream' -d "$payload" \
    "$APP_URL/generate_stream" >"$tmp/stream.code" || fail "POST /generate_stream: request failed"
code=$(cat "$tmp/stream.code")
[[ "$code" == 200 ]] || fail "POST /generate_stream: HTTP $code: $(head -c 500 "$tmp/stream.txt")"
events=$(grep -c '^data:' "$tmp/stream.txt" || true)
((events > 0)) || fail "POST /generate_stream: no 'data:' events in: $(head -c 500 "$tmp/stream.txt")"
log "  $events SSE data events; last: $(grep '^data:' "$tmp/stream.txt" | tail -n1 | head -c 200)"

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

log "all checks passed"
