"""The KV page allocator: a free list of page ids, owned by the (torch-free) scheduler.

The worker's KV pool has `num_pages` pages. Page 0 is reserved: it is the padding page that
CUDA-graph batches and unused block-table slots point at, so it is never handed out.
Pages 1..num_pages-1 are allocatable.

The free list is a LIFO stack in a numpy array (alloc/free are slices, no per-page Python work);
a boolean `is_free` map makes the double-free check one vectorised gather.
All checks run before any state changes, so a rejected free() leaves the allocator intact.
"""

from __future__ import annotations

import numpy as np

RESERVED_PAGE = 0


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.total_pages = num_pages - 1
        # Stack with its top at the end; initialised so that a fresh allocator hands out 1, 2, 3...
        self._stack = np.arange(num_pages - 1, 0, -1, dtype=np.int32)
        self._top = self.total_pages
        self._is_free = np.ones(num_pages, dtype=bool)
        self._is_free[RESERVED_PAGE] = False
        self._scratch = np.zeros(num_pages, dtype=np.int32)  # for the duplicate check in free()
        self._positions = np.arange(num_pages, dtype=np.int32)

    @property
    def free_pages(self) -> int:
        return self._top

    def alloc(self, n: int) -> np.ndarray | None:
        """`n` page ids (int32), or None when fewer than `n` are free (then nothing is taken)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self._top:
            return None
        top = self._top
        pages = self._stack[top - n : top][::-1].copy()
        self._top = top - n
        self._is_free[pages] = False
        return pages

    def free(self, pages: np.ndarray | list[int]) -> None:
        """Return pages to the free list. Raises (and frees nothing) on a double free, the
        reserved page, an out-of-range id, or an id repeated within `pages`."""
        pages = np.asarray(pages)
        if pages.size == 0:
            return
        if pages.ndim != 1 or pages.dtype.kind not in "iu":
            raise ValueError(f"pages must be a 1-D integer array, got {pages.dtype} {pages.shape}")
        lo, hi = int(pages.min()), int(pages.max())
        if lo < 1 or hi >= self.num_pages:
            bad = lo if lo < 1 else hi
            what = "the reserved page" if bad == RESERVED_PAGE else "an out-of-range page"
            raise ValueError(f"free of {what} {bad} (allocatable: 1..{self.num_pages - 1})")
        already = self._is_free[pages]
        if already.any():
            raise ValueError(f"double free of page {int(pages[np.argmax(already)])}")
        n = pages.size
        if n > self.total_pages - self._top:  # more than are in use: some page is repeated
            raise ValueError(f"{n} pages freed but only {self.total_pages - self._top} are in use")
        if n > 1:
            # Duplicates within `pages` without a sort: write each page's position into a
            # scratch map; a repeated page keeps only its last position.
            positions = self._positions[:n]
            self._scratch[pages] = positions
            repeated = self._scratch[pages] != positions
            if repeated.any():
                raise ValueError(f"page {int(pages[np.argmax(repeated)])} freed twice in one call")
        self._stack[self._top : self._top + n] = pages
        self._top += n
        self._is_free[pages] = True

    def free_page_ids(self) -> np.ndarray:
        """A copy of the free list (for integrity checks and tests)."""
        return self._stack[: self._top].copy()

    def check_integrity(self) -> None:
        free = self._stack[: self._top]
        assert 0 <= self._top <= self.total_pages, f"free count {self._top} out of range"
        assert np.unique(free).size == free.size, "a page is on the free list twice"
        assert not self._is_free[RESERVED_PAGE], "the reserved page is marked free"
        marked = np.flatnonzero(self._is_free)
        assert np.array_equal(np.sort(free), marked), "free list and is_free map disagree"

    def __repr__(self) -> str:
        return f"PageAllocator(free={self.free_pages}/{self.total_pages})"
