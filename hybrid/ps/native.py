"""Native kernels for the per-step loops of the sparse path (``_kernels.c``), built on first use.

Three loops dominate the CPU of a step once the messages are few: the trainer's routing of a
batch's ids (deduplicate, group by server and table, build the pooling and backward indices),
and the server's reads and SGD updates of scattered rows. In torch and numpy each is a dozen
or more kernel calls per table and step, each paying Python and dispatch overhead and making
its own pass over the data; ``_kernels.c`` does each in one call for all tables:

- ``hy_route``: one radix sort of the ids packed with their positions (stable, so ties keep
  their order), then linear passes; the same outputs as :meth:`hybrid.ps.fused.FusedPlan.route`
  (tested equal), with the backward's groups already in the reply's row order.
- ``hy_gather``: the rows of every table into the reply, prefetching rows a few ahead.
- ``hy_sgd``: ``w[r] = fma(-lr, g, w[r])`` row by row in order, after checking every id and
  every gradient (nothing is written if one is bad) -- the rounding of torch's ``add_(g,
  alpha=-lr)``, so the weights are the same.
- ``hy_sum_rows``, ``hy_opt_compute``, ``hy_scatter_rows``: adagrad, rowwise_adagrad and adam
  -- contributions summed per row (bit for bit ``index_add_``), every table's new rows and state
  computed and checked before any is written; equal to the torch code to float32 rounding.

The C file is plain C (no Python or torch headers) compiled with the system's C compiler
(``$CC``, else ``cc``) into a private cache directory (``$HYBRID_CACHE_DIR``, else
``$XDG_CACHE_HOME/hybrid`` or ``~/.cache/hybrid``, created ``0700``; one refused if another
user owns it or others may write to it), named by a hash of the source and the command, and
loaded with ``ctypes``. ``runtime.native_kernels`` chooses: ``auto`` (default) uses them when
they build and falls back to the torch code, with one warning, when they do not; ``on``
requires them (an error naming the compiler's complaint); ``off`` never builds them.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

from hybrid.log import warn_once

MODES = ("auto", "on", "off")
SOURCE = Path(__file__).with_name("_kernels.c")
FLAGS = ["-O3", "-std=c11", "-fno-math-errno", "-fPIC", "-shared"]  # sqrt stays exact; vectorizable

BAD_ID, NO_MEMORY, TOO_WIDE, NOT_FINITE = -1, -2, -3, -4

_mode = "auto"
_lib: ctypes.CDLL | None = None
_tried = False
_lock = threading.Lock()


class NativeKernelError(RuntimeError):
    """``runtime.native_kernels: on`` and the kernels could not be built or loaded."""


def configure(*, mode: str) -> None:
    """Process-wide: whether to use the native kernels (``RuntimeOptions.native_kernels``).
    With ``on`` they are built now, so a missing compiler fails at start-up, not mid-step."""
    global _mode, _lib, _tried
    if mode not in MODES:
        raise ValueError(f"native_kernels must be one of {', '.join(MODES)}, got {mode!r}")
    with _lock:
        if mode != _mode:
            _mode, _lib, _tried = mode, None, False
    if mode != "off":
        lib()


def mode() -> str:
    return _mode


def lib() -> ctypes.CDLL | None:
    """The loaded kernels, or ``None`` (``off``, or ``auto`` where they do not build)."""
    global _lib, _tried
    if _lib is not None or _mode == "off":
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        try:
            _lib = _declare(ctypes.CDLL(str(build())))
        except (OSError, subprocess.SubprocessError, NativeKernelError) as e:
            if _mode == "on":
                raise NativeKernelError(f"runtime.native_kernels is 'on' but the native kernels are unavailable: {e}") from e
            warn_once(f"native kernels unavailable, using the torch code instead (runtime.native_kernels: auto): {e}")
    return _lib


def ptr(t) -> int | None:
    """A tensor's address for a kernel argument (``None``: a NULL pointer)."""
    return None if t is None else t.data_ptr()


def cache_dir() -> Path:
    """Where built kernels are kept: private to this user (created ``0700``, refused otherwise)."""
    root = os.environ.get("HYBRID_CACHE_DIR")
    if root:
        d = Path(root)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        d = Path(base) / "hybrid"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = d.stat()
    if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise NativeKernelError(f"cache directory {d} is not private to this user (owner uid {st.st_uid}, "
                                f"mode {stat.filemode(st.st_mode)}); set HYBRID_CACHE_DIR to a directory of your own")
    return d


def build() -> Path:
    """Compile ``_kernels.c`` unless a build of this very source and command is cached; returns
    the shared library's path. Concurrent processes may both compile; each renames its own
    complete file into place, so a reader never sees a partial one."""
    cc = os.environ.get("CC") or "cc"
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(b"\0".join([source, cc.encode(), " ".join(FLAGS).encode(),
                                     platform.machine().encode()])).hexdigest()[:20]
    d = cache_dir()
    target = d / f"kernels-{tag}.so"
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(prefix=".kernels-", suffix=".so", dir=d)
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise NativeKernelError(f"{cc} failed to compile {SOURCE.name}: {done.stderr.strip()[:2000]}")
        os.replace(tmp, target)
    except FileNotFoundError as e:
        raise NativeKernelError(f"no C compiler ({cc!r} not found; set CC)") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _declare(so: ctypes.CDLL) -> ctypes.CDLL:
    i64, p, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    so.hy_route.argtypes = [i64, p, i64, i64, p, p, i64, p, p, p, i64, i64, p, p, p, p, p, p, p, p, p, p, p]
    so.hy_route.restype = i64
    so.hy_gather.argtypes = [p, i64, p, p, p, p, p, p]
    so.hy_gather.restype = i64
    so.hy_sgd.argtypes = [i64, p, p, p, p, p, p, f32, p]
    so.hy_sgd.restype = i64
    so.hy_sum_rows.argtypes = [i64, p, p, i64, f32, i64, p, p, p]
    so.hy_sum_rows.restype = i64
    f64 = ctypes.c_double
    so.hy_opt_compute.argtypes = [i64, i64, i64, i64, p, p, f32, p, p, p, p, f64, f64, f64, f64, f64, p, p, p, p, p]
    so.hy_opt_compute.restype = i64
    so.hy_scatter_rows.argtypes = [p, i64, p, i64, p]
    so.hy_scatter_rows.restype = None
    return so


OPTIMIZERS = {"adagrad": 1, "rowwise_adagrad": 2, "adam": 3}
"""Optimizers ``hy_opt_compute`` implements (plain SGD has ``hy_sgd``), by its kind number."""
