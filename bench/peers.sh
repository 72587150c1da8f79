#!/bin/sh
# Build the benchmark peers Debian does not package into bench/.peers/ (gitignored):
#   bench/.peers/bin/passthrough_hp: libfuse 3's example server example/passthrough_hp.cc
#   (splices reads and writes; a libfuse server without passthrough), taken from the Debian source
#   package of the installed libfuse3 (so it matches the library it links against) and built with
#   g++ -O2 -std=c++17 $features ... $(pkg-config --cflags --libs fuse3) -lpthread, where
#   $features are the HAVE_* macros libfuse's own build (meson's config.h) defines on Linux with
#   glibc: without HAVE_SETXATTR the example has no xattr operations at all (the kernel then stops
#   asking it for any, so it would skip round trips a complete passthrough cannot).
# The source comes through apt-get itself (`apt-get source --download-only`) with a private apt
# configuration under bench/.peers/apt whose deb-src entries are made from this machine's own deb
# entries: the system's apt configuration is not changed. Nothing of libfuse is kept in the repo.
# Needs g++, pkg-config and libfuse3-dev (bench/setup.sh and `scripts/deps.sh --bench` install them).
# Idempotent: does nothing when the binary for the installed libfuse3 version is there.
# The build log is bench/.peers/passthrough_hp.log (the benchmark names it when the build failed).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
peers="$here/.peers"
bin="$peers/bin/passthrough_hp"
log="$peers/passthrough_hp.log"
mkdir -p "$peers/bin"

fail() {
    echo "peers.sh: $*" | tee -a "$log" >&2
    exit 1
}

pkg=libfuse3-3
ver=$(dpkg-query -W -f='${Version}' "$pkg" 2>/dev/null) || ver=""
src=$(dpkg-query -W -f='${source:Package}' "$pkg" 2>/dev/null) || src=""
# What libfuse's meson build finds on Linux/glibc (its test_funcs, and setxattr).
features="-DHAVE_FORK -DHAVE_FSTATAT -DHAVE_OPENAT -DHAVE_READLINKAT -DHAVE_PIPE2 -DHAVE_SPLICE
 -DHAVE_VMSPLICE -DHAVE_POSIX_FALLOCATE -DHAVE_FDATASYNC -DHAVE_UTIMENSAT -DHAVE_COPY_FILE_RANGE
 -DHAVE_FALLOCATE -DHAVE_SETXATTR"
stamp="$src $ver features-v1"
if [ -x "$bin" ] && [ "$(cat "$bin.version" 2>/dev/null)" = "$stamp" ]; then
    echo "peers.sh: passthrough_hp ready ($src $ver)" >&2
    exit 0
fi
: >"$log"
[ -n "$ver" ] && [ -n "$src" ] || fail "$pkg is not installed (apt-get install fuse3)"
command -v g++ >/dev/null 2>&1 || fail "g++ missing (apt-get install g++)"
command -v pkg-config >/dev/null 2>&1 || fail "pkg-config missing (apt-get install pkg-config)"
pkg-config --exists fuse3 || fail "libfuse3-dev missing (apt-get install libfuse3-dev)"
[ "$(pkg-config --modversion fuse3)" = "${ver%%-*}" ] \
    || fail "libfuse3-dev $(pkg-config --modversion fuse3) does not match $pkg $ver"

# A private apt configuration: deb-src twins of the system's deb entries (deb822 and one-line).
apt="$peers/apt"
rm -rf "$apt"
mkdir -p "$apt/parts" "$apt/lists/partial" "$apt/cache/archives/partial"
for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    sed 's/^Types:.*/Types: deb-src/' "$f" >"$apt/parts/$(basename "$f")"
done
for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    sed -n 's/^[[:space:]]*deb[[:space:]]\(.*\)$/deb-src \1/p' "$f" >"$apt/parts/$(basename "$f")"
done
aptopts="-o Dir::Etc::SourceList=/dev/null -o Dir::Etc::SourceParts=$apt/parts -o Dir::State::Lists=$apt/lists
 -o Dir::Cache=$apt/cache -o Debug::NoLocking=1"
echo "peers.sh: fetching the source of $src $ver (apt-get source --download-only)" >&2
# shellcheck disable=SC2086
apt-get $aptopts update >>"$log" 2>&1 || fail "apt-get update of the deb-src entries failed"
work="$peers/src"
rm -rf "$work"
mkdir -p "$work"
# shellcheck disable=SC2086
(cd "$work" && apt-get $aptopts source --download-only "$src=$ver") >>"$log" 2>&1 \
    || fail "apt-get source $src=$ver failed"
orig=$(ls "$work"/"${src}"_*.orig.tar.* 2>/dev/null | grep -v '\.asc$' | head -n 1)
[ -n "$orig" ] || fail "no orig tarball in the source package of $src $ver"
tar -xf "$orig" -C "$work" --wildcards '*/example/passthrough_hp.cc' '*/example/cxxopts.hpp' >>"$log" 2>&1 \
    || fail "example/passthrough_hp.cc not found in $(basename "$orig")"
cc=$(ls "$work"/*/example/passthrough_hp.cc)

echo "peers.sh: building passthrough_hp" >&2
# shellcheck disable=SC2046,SC2086
g++ -O2 -std=c++17 $features -o "$bin.tmp" "$cc" $(pkg-config --cflags --libs fuse3) -lpthread >>"$log" 2>&1 \
    || fail "g++ failed on $cc"
mv "$bin.tmp" "$bin"
echo "$stamp" >"$bin.version"
rm -rf "$work" "$apt"
mv "$log" "$bin.build.log"
echo "peers.sh: built $bin ($src $ver)" >&2
