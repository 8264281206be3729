#!/bin/sh
# A Docker engine and the compose plugin on a Debian 12 (bookworm) host with no registry: what the smoke test
# (deploy/smoke.py) and `make images` need. Root only; each step is skipped when already done.
#
#   sudo deploy/tools/docker-host.sh
#
# 1. Debian's docker.io (dockerd 20.10, containerd, runc) and debootstrap (for deploy/tools/base-debian.sh).
# 2. The compose v2 and buildx plugins: bookworm has only compose v1, so both binaries are taken from Debian 13's
#    docker-compose and docker-buildx packages (Go binaries needing only libc; apt checks each .deb against Debian's
#    signed index) and put where the docker CLI looks for plugins, without installing the packages (their
#    docker-cli dependency would replace bookworm's docker.io).
# 3. dockerd started in the background (no systemd needed) when `docker info` does not answer; its log is
#    /var/log/epd-dockerd.log.
set -eu
[ "$(id -u)" = 0 ] || { echo "docker-host.sh: run as root" >&2; exit 2; }
export DEBIAN_FRONTEND=noninteractive
if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
  apt-get update -qq && apt-get install -y -qq --no-install-recommends docker.io debootstrap >/dev/null
fi
PLUGINS=/usr/local/lib/docker/cli-plugins
if ! docker compose version >/dev/null 2>&1 || ! docker buildx version >/dev/null 2>&1; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  cat > "$work/trixie.sources" <<SRC
Types: deb
URIs: ${DEBIAN_MIRROR:-http://deb.debian.org/debian}
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  mkdir -p "$work/lists/partial" "$work/archives/partial"
  apt_opts="-o Dir::Etc::SourceList=$work/trixie.sources -o Dir::Etc::SourceParts=- -o Dir::State::Lists=$work/lists
            -o Dir::Cache::Archives=$work/archives -o APT::Get::List-Cleanup=0 -o APT::Sandbox::User=root"
  # shellcheck disable=SC2086
  apt-get $apt_opts update -qq
  # shellcheck disable=SC2086
  (cd "$work" && apt-get $apt_opts download -qq docker-compose/trixie docker-buildx/trixie)
  mkdir -p "$PLUGINS"
  for deb in "$work"/docker-compose_*.deb "$work"/docker-buildx_*.deb; do dpkg-deb -x "$deb" "$work/x"; done
  install -m 0755 "$work"/x/usr/libexec/docker/cli-plugins/docker-* "$PLUGINS/"
fi
if ! docker info >/dev/null 2>&1; then
  nohup dockerd >/var/log/epd-dockerd.log 2>&1 &
  i=0
  until docker info >/dev/null 2>&1; do
    i=$((i + 1)); [ $i -le 60 ] || { tail -20 /var/log/epd-dockerd.log >&2; exit 1; }
    sleep 1
  done
fi
echo "docker engine $(docker version -f '{{.Server.Version}}'), compose $(docker compose version --short)"
