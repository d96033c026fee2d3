"""glibc's malloc, told when to hand memory back (one home for the ctypes calls).

Preprocess's processes hold a tokenizer each and encode chunks of text; what glibc keeps of
their freed buffers is copied into every forked worker and counted in the run's peak memory
(docs/benchmarks.md, "Memory with gigatoken"). Where the C library is not glibc (macOS, musl) these
calls do nothing and say so (False).
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
# Long documents, their ids and the encoder's scratch for them. Not the ~1 MiB chunk buffers:
# mapped afresh for every chunk they cost Mistral's gigatoken runs ~4% more CPU in page
# faults, for 10 MB less memory (data_pipeline.benchmark, c:gigatoken, 5 alternated runs).
MMAP_THRESHOLD_BYTES = 4 << 20


def _glibc_function(name: str):
    """`name` from the C library this process runs on, or None where it has none."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):  # macOS, musl: no malloc_trim / mallopt
        return None


def return_freed_memory() -> bool:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; False where
    there is none). Loading a tokenizer.json into gigatoken frees its parse buffers but
    glibc keeps the pages: Llama-3's load leaves the process 117 MB larger, 71 MB after the
    trim, and forked workers would inherit the difference (docs/benchmarks.md: preprocess's peak memory)."""
    trim = _glibc_function("malloc_trim")
    return trim is not None and bool(trim(0))


def keep_large_buffers_unmapped() -> bool:
    """Pin glibc's mmap threshold at MMAP_THRESHOLD_BYTES (False where there is no glibc).
    Above it an allocation is a mapping of its own, handed back when freed; but glibc raises
    the threshold (up to 32 MiB) whenever such a block is freed, after which the next long
    documents come from the heap, whose freed pages stay resident: Llama-3's gigatoken workers
    ended 25 MB larger each on the 108 MB benchmark corpus (docs/benchmarks.md, "Memory with gigatoken").
    The trim threshold is pinned at twice that, as glibc's own rule sets it."""
    mallopt = _glibc_function("mallopt")
    return (mallopt is not None and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
            and mallopt(M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD_BYTES) == 1)
