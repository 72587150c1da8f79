"""The metadata matrix's operations: small-file tree ops, untar, find, du, git status.

Every target works in its own subdirectory of one source directory (``tree``
image): ``<target's view>/<target name>/``.  Per round and target the rows
run in order, each one timed as a whole after dropping the caches:

* ``create``/``stat``/``readdir``/``unlink``: ``bench/metaops.c`` over a tree of
  ``files`` small files (``DIRS`` directories of equal share, 100 bytes each);
* ``untar``: ``tar -xmf`` (times not restored, for every target) of a deterministic synthetic source tree (see
  :func:`build_tarball`) holding a git repository of it;
* ``find``, ``du``: ``find -type f`` and ``du -s`` over the untarred tree;
* ``git-status``: ``git status --porcelain`` in it (after one untimed run that
  refreshes the index the untar left stale).

The figure compared is operations per second (files per second).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import tarfile
from dataclasses import dataclass, field
from typing import Any, Optional

from .fileaccess import build_c

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(BENCH_DIR, "metaops.c")
BUILD_DIR = os.path.join(BENCH_DIR, ".build")
BINARY = os.path.join(BUILD_DIR, "metaops")
FILE_BYTES = 100
FILES_PER_DIR = 1000
TREE_VERSION = 1  # bump when build_tarball changes what it writes
META_OPS = ("create", "stat", "readdir", "unlink")
TREE_OPS = ("untar", "find", "du", "git-status")
# The row whose result a row works on, in the same round and target: after a failed `create`
# or `untar` (a peer out of descriptors, say) the tree is incomplete, and a later row over it
# would time less work than the others did.
PREREQUISITE = {"stat": "create", "readdir": "create", "unlink": "create",
                "find": "untar", "du": "untar", "git-status": "untar"}


def skipped_after(op: str, failed: dict[str, str]) -> Optional[str]:
    """Why row ``op`` is not run, given ``failed`` (op -> error) of this round and target."""
    pre = PREREQUISITE.get(op)
    if pre is None or pre not in failed:
        return None
    return f"not run: the {pre} of this round failed ({failed[pre][:120]}), so the tree is incomplete"
GIT = ["git", "-c", "safe.directory=*", "-c", "core.fsmonitor=false", "-c", "core.untrackedCache=false"]


@dataclass(frozen=True)
class MetaWorkload:
    """One timed metadata operation (``op`` is one of :data:`META_OPS` + :data:`TREE_OPS`)."""

    name: str
    op: str
    kind: str = field(default="metadata", compare=False)

    def describe(self) -> str:
        return {
            "create": "create a tree of small files (mkdir, open O_CREAT, write 100 B, close)",
            "stat": "lstat every file of the tree",
            "readdir": "read every directory of the tree (no stat)",
            "unlink": "unlink every file and rmdir every directory of the tree",
            "untar": "tar -xmf of the synthetic source tree (a git repository; times not restored)",
            "find": "find -type f over the untarred tree",
            "du": "du -s over the untarred tree",
            "git-status": "git status --porcelain in the untarred tree (index refreshed before)",
        }[self.op]


def tree_shape(files: int) -> tuple[int, int]:
    """(directories, files per directory) for a small-file tree of about ``files`` files."""
    per = min(FILES_PER_DIR, max(files, 1))
    return max(1, round(files / per)), per


def build(cc: Optional[str] = None) -> str:
    """Compile metaops.c if needed; return the binary path."""
    return build_c(SOURCE, BINARY, cc)


def tarball_path(files: int) -> str:
    return os.path.join(BUILD_DIR, f"srctree-{files}-v{TREE_VERSION}.tar")


def synthetic_tree(root: str, files: int, seed: int = 27) -> int:
    """Write a deterministic source-like tree of ``files`` files below ``root``; returns the count.

    Directories nest up to four deep with 5 to 40 files each; sizes follow a
    log-uniform law from 64 B to 32 KiB (median about 1.4 KiB, mean
    about 4.7 KiB, like a C source tree); contents are text lines from a fixed generator, so the same
    ``files`` and ``seed`` give the same bytes everywhere.
    """
    rng = random.Random(seed)
    words = ["static", "int", "return", "struct", "const", "void", "if", "for", "while", "unsigned",
             "size_t", "buf", "len", "err", "node", "inode", "page", "queue", "ring", "fuse"]
    done = 0
    dirs = [root]
    os.makedirs(root, exist_ok=True)
    while done < files:
        parent = dirs[rng.randrange(len(dirs))]
        depth = parent[len(root):].count("/")
        d = os.path.join(parent, f"dir{len(dirs):05d}") if depth < 4 else parent
        if d != parent:
            os.makedirs(d, exist_ok=True)
            dirs.append(d)
        for _ in range(min(rng.randint(5, 40), files - done)):
            size = int(2 ** rng.uniform(6, 15))
            line = " ".join(rng.choice(words) for _ in range(8)) + ";\n"
            text = (line * (size // len(line) + 1))[:size]
            ext = rng.choice((".c", ".h", ".rs", ".py", ".md", ".txt"))
            with open(os.path.join(d, f"f{done:06d}{ext}"), "w", encoding="ascii") as f:
                f.write(text)
            done += 1
    return done


def build_tarball(files: int) -> str:
    """``bench/.build/srctree-N-vV.tar``: the synthetic tree of ``files`` files as ``src/``,
    committed into a git repository (``src/.git``, objects in one pack), archived with fixed
    owners and times.

    Built once per size (a few seconds to a minute); the same on every machine.
    """
    out = tarball_path(files)
    if os.path.exists(out):
        return out
    os.makedirs(BUILD_DIR, exist_ok=True)
    work = out + ".work"
    shutil.rmtree(work, ignore_errors=True)
    src = os.path.join(work, "src")
    synthetic_tree(src, files)
    env = {**os.environ, "GIT_AUTHOR_NAME": "fusexbench", "GIT_AUTHOR_EMAIL": "bench@fusex",
           "GIT_COMMITTER_NAME": "fusexbench", "GIT_COMMITTER_EMAIL": "bench@fusex",
           "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z"}
    # One pack, as in a cloned repository (single-threaded: the same pack everywhere).
    for cmd in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "synthetic tree"],
                ["-c", "pack.threads=1", "repack", "-adq"], ["prune-packed"]):
        subprocess.run(GIT + ["-C", src, *cmd], check=True, env=env, stdout=subprocess.DEVNULL)

    def norm(ti: tarfile.TarInfo) -> tarfile.TarInfo:
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = "root"
        ti.mtime = 1767225600
        return ti

    tmp = out + ".tmp"
    with tarfile.open(tmp, "w", format=tarfile.GNU_FORMAT) as tar:
        tar.add(src, arcname="src", filter=norm)  # tarfile adds directory entries sorted
    os.replace(tmp, out)
    shutil.rmtree(work, ignore_errors=True)
    return out


def tarball_entries(path: str) -> int:
    """Entries (files, directories, git objects) in the tarball: the untar row's operation count."""
    with tarfile.open(path) as tar:
        return sum(1 for _ in tar)


def commands(w: MetaWorkload, workdir: str, files: int, binary: str, tarball: str) -> list[list[str]]:
    """(untimed preparation commands..., timed command) of ``w`` in the target's ``workdir``."""
    tree = os.path.join(workdir, "files")
    src = os.path.join(workdir, "src")
    if w.op in META_OPS:
        d, per = tree_shape(files)
        prep = [["rm", "-rf", tree]] if w.op == "create" else []
        return prep + [[binary, w.op, tree, str(d), str(per), str(FILE_BYTES)]]
    if w.op == "untar":
        # -m (--touch): the entries keep the time of extraction, on every target alike; libfuse
        # 3.14's passthrough_hp answers tar's utimensat with EOPNOTSUPP, so restoring the
        # archive's times would fail the row there.
        return [["rm", "-rf", src], ["tar", "-xmf", tarball, "-C", workdir]]
    if w.op == "find":
        return [["find", src, "-type", "f"]]
    if w.op == "du":
        return [["du", "-s", src]]
    if w.op == "git-status":
        status = GIT + ["-C", src, "status", "--porcelain"]
        return [status, status]
    raise ValueError(f"unknown metadata op {w.op!r}")


def parse_output(w: MetaWorkload, stdout: str, ns: int, tree_entries: int) -> dict[str, Any]:
    """The run's figures: time, operations, operations per second.

    metaops prints its own time and count; the other commands are timed by
    the runner around the process, their count is the tree's (find: lines).
    """
    if w.op in META_OPS:
        line = next((l for l in reversed(stdout.strip().splitlines()) if l.startswith("{")), None)
        if line is None:
            raise ValueError(f"no JSON in metaops output: {stdout[:200]!r}")
        d = json.loads(line)
        ns, ops = int(d["ns"]), int(d["ops"])
    elif w.op == "find":
        ops = len(stdout.splitlines())
    else:
        ops = tree_entries
    s = ns / 1e9
    return {"time_ms": ns / 1e6, "ops": ops, "ops_s": ops / s if s > 0 else float("nan"), "ios": ops}
