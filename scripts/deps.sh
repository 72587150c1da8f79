#!/usr/bin/env bash
# Installs what fusex's build, tests and demo need on a fresh Debian 12 machine, and nothing that is
# already there. Safe to run repeatedly.
set -euo pipefail

need=()
have() { command -v "$1" >/dev/null 2>&1; }
have fio || need+=(fio)
have mkfs.ext4 || need+=(e2fsprogs)
have losetup || need+=(util-linux)
have setpriv || need+=(util-linux)
have qemu-img || need+=(qemu-utils)
# sfdisk: tests/partitions.rs partitions MBR and GPT disk images with it.
have sfdisk || need+=(fdisk)
have qemu-nbd || need+=(qemu-utils)
# nbdfuse: a foreign FUSE filesystem that `fusex umount` must refuse (tests/lifecycle.rs).
have nbdfuse || need+=(libnbd-bin)
# NBD servers for tests/nbd.rs (nbdkit also brings the delay filter).
have nbdkit || need+=(nbdkit)
# openssl: tests/nbd.rs makes a CA and certificates for the NBD-over-TLS tests; nbdcopy (libnbd)
# reads a TLS server directly as their oracle.
have openssl || need+=(openssl)
have nbdcopy || need+=(libnbd-bin)
# fusermount3: how a normal user mounts (fusex falls back to it without CAP_SYS_ADMIN).
have fusermount3 || need+=(fuse3)
# systemd-analyze: tests/install.rs verifies contrib/fusex@.service with it.
have systemd-analyze || need+=(systemd)
have python3 || need+=(python3)
# python3-venv: the venv for qemu.qmp below (Debian's python3 has no ensurepip without it).
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
# qemu-storage-daemon: crates/qmp/tests/qemu_client.rs compares fusex's QMP answers with QEMU's
# (and bench/ measures it as a peer).
have qemu-storage-daemon || need+=(qemu-system-common)
# strip: `make install` installs the binary without its debug info.
have strip || need+=(binutils)
# man and groff: tests/install.rs renders every installed man page and fails on any warning.
have man || need+=(man-db)
have groff || need+=(groff-base)
# tmux: tests/top.rs runs `fusex top` on a real terminal (tmux's) and reads the screen back.
have tmux || need+=(tmux)
# prometheus and promtool: tests/metrics.rs checks --metrics-listen's output with promtool and
# scrapes it with a real Prometheus server.
# git, tar, make and a C compiler: tests/dirfs.rs clones, unpacks and builds inside a directory
# export.
have git || need+=(git)
have tar || need+=(tar)
have diff || need+=(diffutils)
have make || need+=(make)
have cc || need+=(gcc)
# setfacl and getfacl: tests/dirfs_ops.rs sets and reads POSIX ACLs through a directory export
# and on its source.
have setfacl || need+=(acl)
have promtool || need+=(prometheus)
have prometheus || need+=(prometheus)
if [ "${1:-}" = "--bench" ]; then
  have gcc || need+=(gcc)
  # libfuse's passthrough_hp, a peer that bench/peers.sh builds; valgrind for bench/instructions.sh.
  have g++ || need+=(g++)
  have pkg-config || need+=(pkg-config)
  [ -f /usr/include/fuse3/fuse_lowlevel.h ] || need+=(libfuse3-dev)
  have valgrind || need+=(valgrind)
  # bindfs: a peer of the dirfs and metadata matrices (directory exports).
  have bindfs || need+=(bindfs)
fi
if [ ${#need[@]} -gt 0 ]; then
  echo "installing: ${need[*]}"
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi

# qemu.qmp, QEMU's own QMP client library, in a venv under target/ (ignored by git; `cargo clean`
# removes it and the next run makes it again): crates/qmp/tests/qemu_client.rs drives fusex's QMP
# server with it.
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/target/qmp-venv"
if ! "$venv/bin/python3" -c 'import qemu.qmp' >/dev/null 2>&1; then
  echo "installing qemu.qmp into target/qmp-venv"
  mkdir -p "$root/target"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check 'qemu.qmp==0.0.6'
fi

if ! have cargo; then
  echo "installing the Rust toolchain (rustup, stable)"
  curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --component clippy,rustfmt
  # shellcheck disable=SC1091
  . "$HOME/.cargo/env"
fi
for c in clippy rustfmt; do
  rustup component list --installed 2>/dev/null | grep -q "^$c" || rustup component add "$c" >/dev/null 2>&1 || true
done

# pjdfstest, the POSIX file system conformance suite (crates.io): tests/dirfs.rs runs it on the
# source directory and through a directory export and compares.
# As root it goes to /usr/local (on PATH, kept across clones: building it takes a minute); as a
# normal user, to target/tools of this clone.
if ! have pjdfstest && [ ! -x "$root/target/tools/bin/pjdfstest" ]; then
  if [ "$(id -u)" -eq 0 ]; then tools=/usr/local; else tools="$root/target/tools"; fi
  echo "installing pjdfstest into $tools"
  cargo install --quiet --locked pjdfstest --version 0.2.2 --root "$tools"
fi

# Unprivileged FUSE needs /dev/fuse open to everyone (fusermount3 opens it as the user); udev
# makes it 0666 on a normal Debian system, a machine without udev may leave it 0600.
if [ -c /dev/fuse ] && [ "$(stat -c %a /dev/fuse)" != 666 ] && [ "$(id -u)" -eq 0 ]; then
  chmod 0666 /dev/fuse && echo "made /dev/fuse usable by normal users (mode 0666, as udev does)"
fi

# FUSE-over-io_uring is off by default; enable it where we may (the daemon itself never does).
p=/sys/module/fuse/parameters/enable_uring
if [ -w "$p" ] && [ "$(cat "$p")" != "Y" ]; then
  echo Y > "$p" && echo "enabled FUSE-over-io_uring ($p = Y)"
fi
