"""Peak resident memory of a call, as the kernel counts it (Linux).

Writing ``5`` to ``/proc/self/clear_refs`` resets the process's high-water
mark (``VmHWM``) to its current RSS, so the growth of the peak during a call
is ``VmHWM`` after it minus ``VmRSS`` before it, page-exact. Used by the
bookkeeping tests and ``benchmarks/memory.py``.
"""

import time


def _status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def peak_growth(fn, *args, **kwargs):
    """Runs ``fn``; returns ``(result, peak RSS growth in MB, seconds)``."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kb("VmRSS")
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    seconds = time.perf_counter() - start
    return result, (_status_kb("VmHWM") - before) / 1024, seconds


def fixed_mmap_threshold(nbytes=1 << 20):
    """Makes glibc map every block above ``nbytes`` on its own and unmap it when freed.

    Setting the threshold turns off glibc's dynamic one, which rises to the
    largest mapped block freed so far; later blocks of that size then come from
    the heap, and where they land moved the peak of the same evaluation by up to
    32 MB between runs. Called in a test's process before it measures.
    """
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, nbytes)  # -3: M_MMAP_THRESHOLD
