"""Allocator tuning for sweeps; imports nothing heavy, so the CLI can call it first."""

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters, from glibc's malloc.h


def _libc():
    """glibc, or None where there is none (macOS, Windows, musl)."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018  (glibc has both)
    except (OSError, AttributeError):
        return None
    return libc


def tune_allocator() -> bool:
    """Tell glibc's malloc to keep freed memory instead of returning it to the system.

    A sweep allocates and frees the same large activations hundreds of times; by default
    glibc serves them with mmap and unmaps them on free, so every variant pays page faults
    for fresh zeroed pages. Equivalent to MALLOC_MMAP_MAX_=0 and a huge
    MALLOC_TRIM_THRESHOLD_. Returns False where there is no glibc.
    """
    libc = _libc()
    return libc is not None and bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def untune() -> bool:
    """glibc's defaults again (large blocks mmapped, and unmapped when freed): for a corpus,
    whose documents of many lengths would otherwise fragment a heap that keeps everything,
    so that peak memory does not creep up with the number of documents."""
    libc = _libc()
    return libc is not None and bool(libc.mallopt(M_MMAP_MAX, 65536)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, 128 * 1024))


def release() -> bool:
    """Hand freed heap pages back to the system (glibc's malloc_trim). With the allocator
    tuned, freed memory is kept for reuse; between documents of different lengths the
    differently sized blocks fragment the heap and RSS would creep up with the corpus, so
    a corpus sweep releases it after each document (one page-fault round per document,
    not per variant). Returns False where there is no glibc."""
    libc = _libc()
    return libc is not None and bool(libc.malloc_trim(0))
