#!/bin/sh
# Install what the benchmark suite needs (Debian/Ubuntu):
#   fio, qemu-storage-daemon (qemu-system-common), qemu-nbd (qemu-utils),
#   nbdfuse (libnbd-bin), nbdkit (the nbd matrix's delay server), fusermount3 (fuse3),
#   gcc (for bench/fileaccess.c),
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
echo "setup.sh: ready ($("$here/.venv/bin/python3" -c 'import matplotlib; print("matplotlib", matplotlib.__version__)'))" >&2
