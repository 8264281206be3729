#!/bin/sh
# The wheels an image installs, fetched on this host so the image build needs no network (`pip install --no-index`).
#
#   deploy/tools/wheelhouse.sh LOCK [OUT]     LOCK: proxy | worker-cpu | worker-cuda   (default OUT: build/wheelhouse/LOCK)
#
# OUT/wheels gets every wheel pinned in deploy/requirements/LOCK.txt, checked against its hashes (--require-hashes),
# for the image's Python (CPython 3.11, x86_64, glibc 2.36) whatever this host runs, and the lock as
# OUT/requirements.txt; OUT/epd gets the project's own wheel and deploy/k8s/epd_register.py (apart, so that a code
# change rebuilds only the image's last layers). That folder is the whole build context of the image, so an
# air-gapped build copies it (and deploy/Dockerfile) to the build machine. PIP_INDEX_URL / PIP_FIND_LINKS point pip at
# a mirror. A wheel already in OUT with a listed hash is not fetched again.
set -eu
LOCK=${1:?usage: wheelhouse.sh proxy|worker-cpu|worker-cuda [OUT]}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${2:-$ROOT/build/wheelhouse/$LOCK}
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
REQS="$ROOT/deploy/requirements/$LOCK.txt"
[ -f "$REQS" ] || { echo "wheelhouse.sh: no lock $REQS" >&2; exit 2; }
mkdir -p "$OUT/wheels" "$OUT/epd"
# the image's platform: glibc 2.36 (bookworm) runs every manylinux wheel up to 2_36
PLATFORMS=$(for minor in $(seq 17 36); do printf -- '--platform manylinux_2_%s_x86_64 ' "$minor"; done)
# shellcheck disable=SC2086
"$PYTHON" -m pip download --quiet --no-deps --require-hashes --only-binary=:all: --dest "$OUT/wheels" \
  --python-version 3.11 --implementation cp --abi cp311 --abi abi3 --abi none \
  $PLATFORMS --platform manylinux2014_x86_64 \
  ${FIND_LINKS:+--find-links "$FIND_LINKS"} -r "$REQS"
rm -f "$OUT"/epd/disagg_epd-*.whl
"$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$OUT/epd" "$ROOT"
rm -rf "$ROOT"/build/lib "$ROOT"/build/bdist.* "$ROOT"/disagg_epd.egg-info
cp "$REQS" "$OUT/requirements.txt"
cp "$ROOT/deploy/k8s/epd_register.py" "$OUT/epd/epd-register"
echo "$OUT: $(ls "$OUT"/wheels/*.whl | wc -l) wheels, $(du -sh "$OUT" | cut -f1)"
