#!/bin/sh
# EPD's images, built offline: the wheelhouses on this host, then `docker build` with no network.
#
#   deploy/tools/images.sh [cpu|cuda]       (make images; default cpu)
#
# Builds epd-proxy:latest (no torch, no transformers) and epd-worker:cpu (or :cuda, from the worker-cuda lock: the
# same base, PyPI's CUDA torch brings its own CUDA libraries). The base is BASE_IMAGE when set (a registry image,
# pinned by digest where you can: python:3.11-slim-bookworm@sha256:...); else epd-base:bookworm when it exists;
# else python:3.11-slim-bookworm when a registry answers; else deploy/tools/base-debian.sh makes epd-base:bookworm
# from Debian's mirror (root and debootstrap). A registry base is then built from by its digest; every build
# records the base's image ID. Each phase's seconds and each image's size go to
# build/images-<variant>.json (and stdout).
set -eu
VARIANT=${1:-cpu}
case "$VARIANT" in cpu|cuda) ;; *) echo "images.sh: cpu or cuda, not $VARIANT" >&2; exit 2 ;; esac
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
command -v docker >/dev/null && docker info >/dev/null 2>&1 || {
  echo "images.sh: no Docker engine answers (docker info); see docs/DEPLOY.md, 'Building the images'" >&2; exit 2; }
now() { date +%s.%N; }
TIMES=""
phase() {  # phase NAME COMMAND...: runs it, records its seconds
  name=$1; shift
  t0=$(now); "$@"; t1=$(now)
  secs=$(python3 -c "print(round($t1 - $t0, 1))")
  echo "[images] $name: $secs s"
  TIMES="$TIMES\"$name\": $secs, "
}
if [ -z "${BASE_IMAGE:-}" ]; then
  if docker image inspect epd-base:bookworm >/dev/null 2>&1; then BASE_IMAGE=epd-base:bookworm
  elif docker pull -q python:3.11-slim-bookworm >/dev/null 2>&1; then BASE_IMAGE=python:3.11-slim-bookworm
  else phase base deploy/tools/base-debian.sh epd-base:bookworm; BASE_IMAGE=epd-base:bookworm
  fi
fi
# pinned: a registry image by its digest (repo@sha256:...), a local one (docker import) by the ID it has now
BASE_ID=$(docker image inspect -f '{{.Id}}' "$BASE_IMAGE")
BASE_DIGEST=$(docker image inspect -f '{{if .RepoDigests}}{{index .RepoDigests 0}}{{end}}' "$BASE_IMAGE")
if [ -n "$BASE_DIGEST" ] && [ "${BASE_IMAGE#*@sha256:}" = "$BASE_IMAGE" ]; then BASE_IMAGE=$BASE_DIGEST; fi
echo "[images] base: $BASE_IMAGE ($BASE_ID)"
build() {  # build TARGET LOCK TAG
  docker build --quiet -f deploy/Dockerfile --target "$1" --build-arg BASE_IMAGE="$BASE_IMAGE" -t "$3" \
    "build/wheelhouse/$2" >/dev/null
}
phase wheelhouse-proxy deploy/tools/wheelhouse.sh proxy
phase wheelhouse-worker deploy/tools/wheelhouse.sh "worker-$VARIANT"
phase image-proxy build proxy proxy epd-proxy:latest
phase image-worker build worker "worker-$VARIANT" "epd-worker:$VARIANT"
size() { docker image inspect -f '{{.Size}}' "$1"; }
mkdir -p build
cat > "build/images-$VARIANT.json" <<JSON
{"base": "$BASE_IMAGE", "base_id": "$BASE_ID", "seconds": {${TIMES%, }},
 "bytes": {"epd-proxy:latest": $(size epd-proxy:latest), "epd-worker:$VARIANT": $(size "epd-worker:$VARIANT"),
           "base": $(size "$BASE_IMAGE")}}
JSON
docker images --format '{{.Repository}}:{{.Tag}}  {{.Size}}' | grep -E "^(epd-proxy:latest|epd-worker:$VARIANT) "
