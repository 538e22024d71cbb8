#!/usr/bin/env bash
# The Docker engine the `docker` test tier runs on, from Debian's packages only (no image registry, no Docker
# apt repository needed). As root on Debian bookworm:
#
#   .ci/docker-engine.sh install   docker.io (Docker 20.10), debootstrap + busybox-static (deploy/images.sh),
#                                  acl (setfacl: the secured compose recipe), and Compose v2 (`docker compose`)
#   .ci/docker-engine.sh start     start dockerd in the background unless an engine already answers; prints
#                                  the pid it started (nothing when it started none); log: $DOCKERD_LOG
#   .ci/docker-engine.sh stop PID  stop that dockerd (and the containerd it runs) and wait for it
#
# Compose v2: docker-compose.yml uses `${VAR:+replacement}`, which Debian bookworm's docker-compose 1.29 (v1)
# refuses ("Invalid interpolation format"); bookworm has no Compose v2 package, trixie's docker-compose 2.26
# (one Go binary, needing libc6 >= 2.34: bookworm has 2.36) is installed as the CLI plugin, leaving apt's
# sources and packages as they were.
set -euo pipefail
DOCKERD_LOG=${DOCKERD_LOG:-/var/log/yeto-ci-dockerd.log}
PLUGIN=/usr/libexec/docker/cli-plugins/docker-compose
COMPOSE_V2=${YETO_COMPOSE_V2_VERSION:-2.26.1-4}
MIRROR=${YETO_DEBIAN_MIRROR:-http://deb.debian.org/debian}

log() { echo "[docker-engine] $*" >&2; }

install_compose_v2() {
    docker compose version >/dev/null 2>&1 && return 0
    local d; d=$(mktemp -d)
    mkdir -p "$d/lists/partial"
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR trixie main" > "$d/sources.list"
    # A private list directory: the host's apt state is not touched.
    local opts=(-o "Dir::Etc::sourcelist=$d/sources.list" -o Dir::Etc::sourceparts=- -o "Dir::State::Lists=$d/lists"
                -o APT::Sandbox::User=root)
    apt-get "${opts[@]}" update -qq
    (cd "$d" && apt-get "${opts[@]}" download -qq "docker-compose=$COMPOSE_V2")
    dpkg-deb -x "$d"/docker-compose_*.deb "$d/x"
    install -D -m 755 "$d/x/usr/libexec/docker/cli-plugins/docker-compose" "$PLUGIN"
    rm -rf "$d"
    docker compose version >&2
}

case "${1:-}" in
    install)
        [ "$(id -u)" = 0 ] || { log "needs root"; exit 2; }
        need=()
        command -v dockerd >/dev/null || need+=(docker.io)
        command -v debootstrap >/dev/null || need+=(debootstrap)
        [ -x /bin/busybox ] && dpkg -s busybox-static >/dev/null 2>&1 || need+=(busybox-static)
        command -v setfacl >/dev/null || need+=(acl)
        if [ ${#need[@]} -gt 0 ]; then
            log "apt-get install ${need[*]}"
            apt-get update -qq
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
        fi
        install_compose_v2
        ;;
    start)
        if docker info >/dev/null 2>&1; then
            log "an engine already answers: using it (and leaving it running)"
            exit 0
        fi
        log "starting dockerd (log: $DOCKERD_LOG)"
        nohup dockerd >"$DOCKERD_LOG" 2>&1 </dev/null &
        pid=$!
        for _ in $(seq 60); do
            docker info >/dev/null 2>&1 && { echo "$pid"; exit 0; }
            kill -0 "$pid" 2>/dev/null || break
            sleep 1
        done
        log "dockerd did not come up; its log:"; tail -20 "$DOCKERD_LOG" >&2
        kill "$pid" 2>/dev/null || true
        exit 1
        ;;
    stop)
        pid=${2:?"stop needs the pid that start printed"}
        kill -TERM "$pid" 2>/dev/null || exit 0
        for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || exit 0; sleep 1; done
        log "dockerd $pid still runs after 30 s: SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        ;;
    *) sed -n '2,12p' "$0"; exit 2 ;;
esac
