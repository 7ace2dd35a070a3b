#!/usr/bin/env bash
# Vulkan on CPU for ManiSkill3: Mesa 25's lavapipe from bookworm-backports, unpacked into a
# project folder. The system's apt sources are never touched.
#
#   bash deploy/setup/vulkan.sh            # prints the ICD json path on its last line
#   NEXUS_VULKAN_DIR=/elsewhere bash deploy/setup/vulkan.sh
#
# ManiSkill (SAPIEN) needs a Vulkan device even for state observations. Debian 12's own
# lavapipe (Mesa 22) is rejected by SAPIEN; the one from bookworm-backports (Mesa 25) works.
# Steps:
#   1. the system's Vulkan loader (libvulkan1) and the driver's runtime libraries, through the
#      system's apt-get, only where missing (needs root then);
#   2. a private apt config (own sources list with bookworm-backports, own lists, cache and
#      status) -> `apt-get download mesa-vulkan-drivers` -> `dpkg -x` into $DEST/root;
#   3. $DEST/lvp_icd.json: a copy of the lavapipe ICD json with an absolute library_path;
#   4. a probe that creates a Vulkan instance through that ICD and names the device.
# envs/maniskill.py points VK_ICD_FILENAMES at $DEST/lvp_icd.json (DEST defaults to
# <venv>/vulkan, so `make clean` removes it). A second run only re-checks and re-probes (~0.1 s).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEST="${NEXUS_VULKAN_DIR:-$ROOT/.venv/vulkan}"
SUITE="${NEXUS_VULKAN_SUITE:-bookworm-backports}"
MIRROR="${NEXUS_VULKAN_MIRROR:-http://deb.debian.org/debian}"
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
PKG=mesa-vulkan-drivers
MIN_MESA=25  # Mesa 22 (bookworm) is rejected by SAPIEN; 25 (bookworm-backports) is what was verified
ICD="$DEST/lvp_icd.json"
STAMP="$DEST/.done"
APT_DIR="$DEST/apt"

die() { echo "vulkan.sh: error: $*" >&2; exit 1; }
log() { echo "vulkan.sh: $*" >&2; }

have_loader() { ldconfig -p 2>/dev/null | grep -q 'libvulkan\.so\.1 '; }

# Installs system packages (only called for missing ones): retries once after apt-get update.
system_install() {
  [ "$(id -u)" = 0 ] || die "need root to apt-get install $* (or install them yourself)"
  log "apt-get install $*"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends "$@" >&2 \
    || { apt-get update -q >&2 && apt-get install -y -q --no-install-recommends "$@" >&2; } \
    || die "apt-get install $* failed"
}

# Creates a Vulkan instance through $ICD only and prints the device; fails if none.
probe() {
  command -v python3 >/dev/null || die "python3 not found (needed for the Vulkan probe)"
  VK_ICD_FILENAMES="$ICD" VK_DRIVER_FILES="$ICD" python3 - <<'EOF'
import ctypes, sys
vk = ctypes.CDLL("libvulkan.so.1")
class InstanceCreateInfo(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p), ("flags", ctypes.c_uint32),
                ("pApplicationInfo", ctypes.c_void_p), ("enabledLayerCount", ctypes.c_uint32),
                ("ppEnabledLayerNames", ctypes.c_void_p), ("enabledExtensionCount", ctypes.c_uint32),
                ("ppEnabledExtensionNames", ctypes.c_void_p)]
vk.vkCreateInstance.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
vk.vkEnumeratePhysicalDevices.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
vk.vkGetPhysicalDeviceProperties.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
vk.vkDestroyInstance.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
inst = ctypes.c_void_p()
rc = vk.vkCreateInstance(ctypes.byref(InstanceCreateInfo(sType=1)), None, ctypes.byref(inst))
if rc != 0:
    sys.exit(f"vkCreateInstance returned {rc} (-9: no driver loaded; run with VK_LOADER_DEBUG=all to see why)")
n = ctypes.c_uint32(0)
vk.vkEnumeratePhysicalDevices(inst, ctypes.byref(n), None)
if n.value == 0:
    sys.exit("Vulkan instance has no physical device")
devs = (ctypes.c_void_p * n.value)()
vk.vkEnumeratePhysicalDevices(inst, ctypes.byref(n), devs)
props = ctypes.create_string_buffer(4096)  # VkPhysicalDeviceProperties is ~830 bytes
vk.vkGetPhysicalDeviceProperties(devs[0], props)
api = int.from_bytes(props.raw[0:4], "little")
name = props.raw[20:276].split(b"\0")[0].decode()
print(f"{name}, Vulkan {api >> 22}.{(api >> 12) & 0x3ff}.{api & 0xfff}")
vk.vkDestroyInstance(inst, None)
EOF
}

# The first alternative of each Depends entry of a .deb, without version constraints.
deb_depends() {
  dpkg-deb -f "$1" Depends | tr ',' '\n' | sed -E 's/\|.*//; s/\(.*\)//; s/:any//; s/[[:space:]]//g' | grep -v '^$'
}

# -- 1. the system's Vulkan loader ------------------------------------------------------------
have_loader || system_install libvulkan1
have_loader || die "libvulkan.so.1 still not found after installing libvulkan1"

# -- fast path: already unpacked and still loadable -------------------------------------------
if [ -f "$STAMP" ] && [ -f "$ICD" ]; then
  if device="$(probe 2>&1)"; then
    log "already set up: $(cat "$STAMP"); device: $device"
    echo "$ICD"
    exit 0
  fi
  log "existing setup in $DEST no longer works ($device); redoing it"
fi

# -- 2. private apt config: own sources, lists, cache and status ------------------------------
for tool in apt-get dpkg-deb dpkg; do command -v "$tool" >/dev/null || die "$tool not found (Debian/Ubuntu only)"; done
[ -r "$KEYRING" ] || die "$KEYRING not found (install debian-archive-keyring)"
rm -rf "$DEST/root" "$DEST/debs" "$STAMP"
mkdir -p "$APT_DIR"/{lists/partial,cache/archives/partial,sources.list.d,preferences.d} "$DEST/debs"
: > "$APT_DIR/status"
echo "deb [signed-by=$KEYRING] $MIRROR $SUITE main" > "$APT_DIR/sources.list"
cat > "$APT_DIR/apt.conf" <<EOF
Dir::Etc::SourceList "$APT_DIR/sources.list";
Dir::Etc::SourceParts "$APT_DIR/sources.list.d";
Dir::Etc::Preferences "$APT_DIR/preferences";
Dir::Etc::PreferencesParts "$APT_DIR/preferences.d";
Dir::State "$APT_DIR";
Dir::State::Lists "$APT_DIR/lists";
Dir::State::status "$APT_DIR/status";
Dir::Cache "$APT_DIR/cache";
Debug::NoLocking "true";
APT::Sandbox::User "root";
EOF
export APT_CONFIG="$APT_DIR/apt.conf"
log "apt-get update ($SUITE, private lists in $APT_DIR)"
apt-get update -q --error-on=any >&2 || die "apt-get update of $SUITE from $MIRROR failed"
(cd "$DEST/debs" && apt-get download -q "$PKG" >&2) || die "apt-get download $PKG from $SUITE failed"
unset APT_CONFIG
deb="$(ls "$DEST"/debs/${PKG}_*.deb)"
version="$(dpkg-deb -f "$deb" Version)"
dpkg --compare-versions "$version" ge "$MIN_MESA" \
  || die "$PKG $version from $SUITE is older than Mesa $MIN_MESA (SAPIEN rejects Mesa 22's lavapipe)"
dpkg -x "$deb" "$DEST/root"

# -- the driver's runtime libraries: system packages (bookworm has them all) ------------------
missing=()
for dep in $(deb_depends "$deb"); do
  dpkg-query -W -f='${db:Status-Abbrev}' "$dep" 2>/dev/null | grep -q '^ii' || missing+=("$dep")
done
[ "${#missing[@]}" = 0 ] || system_install "${missing[@]}"

lib="$(find "$DEST/root" -name libvulkan_lvp.so -print -quit)"
[ -n "$lib" ] || die "libvulkan_lvp.so not found in $deb"
unresolved="$(ldd "$lib" | grep 'not found' || true)"
[ -z "$unresolved" ] || die "$lib needs libraries this system lacks:
$unresolved"

# -- 3. the ICD json with an absolute library_path ---------------------------------------------
src_icd="$(find "$DEST/root" -name 'lvp_icd*.json' -print -quit)"
[ -n "$src_icd" ] || die "lvp ICD json not found in $deb"
sed -E "s#\"library_path\"[[:space:]]*:[[:space:]]*\"[^\"]*\"#\"library_path\": \"$lib\"#" "$src_icd" > "$ICD"
grep -q "\"library_path\": \"$lib\"" "$ICD" || die "could not rewrite library_path in $ICD"

# -- 4. probe ---------------------------------------------------------------------------------
device="$(probe 2>&1)" || die "Vulkan probe through $ICD failed: $device"
rm -rf "$DEST/debs" "$APT_DIR/cache"  # the unpacked tree is all that is needed
echo "$PKG $version" > "$STAMP"
log "$PKG $version unpacked in $DEST; device: $device"
echo "$ICD"
