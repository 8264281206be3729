#!/bin/sh
# A Debian base image with Python 3.11, built from Debian's own package mirror: for hosts that cannot pull from a
# registry (air-gapped clusters, build machines behind a package mirror). Needs root, debootstrap and docker.
#
#   deploy/tools/base-debian.sh [TAG]          (default TAG: epd-base:bookworm)
#
# MIRROR picks the mirror; a snapshot makes the base reproducible, e.g.
#   MIRROR=http://snapshot.debian.org/archive/debian/20260501T000000Z deploy/tools/base-debian.sh
# The image gets python3 (3.11, what the locks in deploy/requirements/ are for) and ca-certificates, nothing else;
# apt's caches, docs, man pages and locales are removed (127 MB). Prints the image ID: pin builds to it with
# BASE_IMAGE=<that id>, as you would pin a registry image by digest.
set -eu
TAG=${1:-epd-base:bookworm}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
[ "$(id -u)" = 0 ] || { echo "base-debian.sh: debootstrap needs root" >&2; exit 2; }
command -v debootstrap >/dev/null || { echo "base-debian.sh: apt-get install debootstrap" >&2; exit 2; }
ROOTFS=$(mktemp -d /tmp/epd-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT
debootstrap --variant=minbase --include=python3,ca-certificates "$SUITE" "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1 \
  || { tail -20 "$ROOTFS.log" >&2; exit 1; }
rm -f "$ROOTFS.log"
rm -rf "$ROOTFS"/var/cache/apt/* "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* \
       "$ROOTFS"/usr/share/info/* "$ROOTFS"/var/log/* "$ROOTFS"/tmp/*
find "$ROOTFS/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
printf '%s\n' "$MIRROR $SUITE" > "$ROOTFS/etc/epd-base-source"
tar --numeric-owner -C "$ROOTFS" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
  --change 'CMD ["python3"]' - "$TAG" >/dev/null
docker image inspect --format '{{.Id}}' "$TAG"
