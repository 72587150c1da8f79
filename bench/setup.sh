#!/bin/sh
# Install what the benchmark suite needs (Debian/Ubuntu):
#   fio, qemu-storage-daemon (qemu-system-common), qemu-nbd (qemu-utils),
#   nbdfuse (libnbd-bin), nbdkit (the nbd matrix's delay server), fusermount3 (fuse3),
#   bindfs (a peer of the dirfs and metadata matrices), git (the metadata matrix's git status),
#   gcc (for bench/fileaccess.c), g++, pkg-config and libfuse3-dev (for libfuse's passthrough_hp,
#   which bench/peers.sh builds into bench/.peers/), valgrind (bench/instructions.sh),
# and bench/.venv with matplotlib for the plots. Idempotent.
set -eu
here=$(cd "$(dirname "$0")" && pwd)

need=""
command -v fio >/dev/null 2>&1 || need="$need fio"
command -v qemu-storage-daemon >/dev/null 2>&1 || need="$need qemu-system-common"
command -v qemu-nbd >/dev/null 2>&1 || need="$need qemu-utils"
command -v nbdfuse >/dev/null 2>&1 || need="$need libnbd-bin"
command -v nbdkit >/dev/null 2>&1 || need="$need nbdkit"
command -v fusermount3 >/dev/null 2>&1 || need="$need fuse3"
command -v gcc >/dev/null 2>&1 || need="$need gcc"
command -v bindfs >/dev/null 2>&1 || need="$need bindfs"
command -v git >/dev/null 2>&1 || need="$need git"
# libfuse's passthrough_hp peer (built by bench/peers.sh)
command -v g++ >/dev/null 2>&1 || need="$need g++"
command -v pkg-config >/dev/null 2>&1 || need="$need pkg-config"
[ -f /usr/include/fuse3/fuse_lowlevel.h ] || need="$need libfuse3-dev"
# bench/instructions.sh (instructions per request)
command -v valgrind >/dev/null 2>&1 || need="$need valgrind"
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need="$need python3-venv"
if [ -n "$need" ]; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo=sudo
    echo "setup.sh: installing$need" >&2
    $sudo apt-get update
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y --no-install-recommends $need
fi

if [ ! -x "$here/.venv/bin/python3" ]; then
    python3 -m venv "$here/.venv"
fi
if ! "$here/.venv/bin/python3" -c 'import matplotlib' >/dev/null 2>&1; then
    "$here/.venv/bin/pip" install --quiet --disable-pip-version-check matplotlib
fi
sh "$here/peers.sh" || echo "setup.sh: passthrough_hp not built (see bench/.peers/passthrough_hp.log): the" \
    "side-by-side matrix skips it" >&2
echo "setup.sh: ready ($("$here/.venv/bin/python3" -c 'import matplotlib; print("matplotlib", matplotlib.__version__)'))" >&2
