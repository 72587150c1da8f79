"""fusexbench: the fusex benchmark suite.

fio workloads (and a small file-access program) run against several FUSE
image exports mounted side by side: the image itself (``native``), ``fusex``
in each configuration worth comparing, qemu-storage-daemon's FUSE export
(``qsd``) and ``nbdfuse`` over ``qemu-nbd``.  Targets stay mounted for the
whole matrix and are measured interleaved, round after round; the report
gives medians, spread and the median of per-round ratios.

Modules: ``fio`` (command lines, JSON parsing), ``fileaccess`` (the
passthrough test program), ``images``, ``targets`` (start/stop, signal
guards), ``matrices``, ``stats``, ``report`` (markdown), ``plots``
(matplotlib, optional), ``machine``, ``progress``, ``runner``.
"""

__version__ = "0.1.0"
