"""Whole KV pages between the device pool's per-layer buffers and a page-major buffer, every
layer in one launch (the host tier's staging buffer, worker/host_pool.py), and the torch
reference.

The device pool keeps one K and one V buffer per layer; a page of one of them is `ROW` contiguous
elements (page_size * kv_heads * head_dim) at `page * ROW`. A page-major buffer
[n, J, ROW] holds, for each of n pages, its J rows (J = 2 * layers: layer 0's K, layer 0's V,
layer 1's K, ...). The kernel reaches the J buffers through a table of their addresses
(`buffer_table`), so a load's scatter or a write's gather of any number of layers is one launch
instead of one per layer and K/V (a chunk of the staging buffer at Llama-3.1-8B's 32 layers:
64 launches): the side stream's kernels wait for SMs beside the compute stream's, once per
launch. It moves raw bits (any element type of the pool's width).
"""

from __future__ import annotations

import inspect

import torch

from radix_runtime.worker.kernels._triton import tl, triton

# each program moves about this many bytes: several pages when a page's row is small (page size 1)
_PROGRAM_BYTES = 32 << 10
_BLOCK_BYTES = 8 << 10


# the page count and the ids' address change batch to batch (a group's ids are a slice of the
# batch's): no compile per value or alignment
_NO_SPECIALIZE = {"do_not_specialize": ["n", "idx_ptr"]}
if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
    _NO_SPECIALIZE["do_not_specialize_on_alignment"] = ["n", "idx_ptr"]


@triton.jit(**_NO_SPECIALIZE)
def _page_copy_kernel(
    table_ptr,  # [J] int64: the address of each buffer
    idx_ptr,  # [n] int64: the device page of each of the n pages
    pages_ptr,  # [n, J, ROW]: page major
    n,
    J: tl.constexpr,
    ROW: tl.constexpr,
    PAGES: tl.constexpr,  # pages per program
    BLOCK: tl.constexpr,
    GATHER: tl.constexpr,  # buffers -> pages (a write), else pages -> buffers (a load)
):
    j = tl.program_id(0)
    first = tl.program_id(1).to(tl.int64) * PAGES
    buf = tl.load(table_ptr + j).to(tl.pointer_type(pages_ptr.dtype.element_ty))
    offs = tl.arange(0, BLOCK)
    for p in range(PAGES):
        i = first + p
        if i < n:
            page = tl.load(idx_ptr + i).to(tl.int64)
            dev = buf + page * ROW
            staged = pages_ptr + (i * J + j) * ROW
            for start in range(0, ROW, BLOCK):
                mask = start + offs < ROW
                if GATHER:
                    x = tl.load(dev + start + offs, mask=mask)
                    tl.store(staged + start + offs, x, mask=mask)
                else:
                    x = tl.load(staged + start + offs, mask=mask)
                    tl.store(dev + start + offs, x, mask=mask)


def buffer_table(buffers: list[torch.Tensor]) -> torch.Tensor:
    """The addresses of `buffers` (every one on the same device, contiguous, of one element
    size) as the int64 table `page_copy` reads; the buffers must outlive it."""
    first = buffers[0]
    for b in buffers:
        if b.device != first.device or not b.is_contiguous():
            raise ValueError("page_copy needs contiguous buffers on one device")
        if b.element_size() != first.element_size():
            raise ValueError("page_copy needs buffers of one element size")
    return torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=first.device)


def page_copy(
    table: torch.Tensor,
    idx: torch.Tensor,
    pages: torch.Tensor,
    row: int,
    gather: bool,
) -> None:
    """`gather`: pages[i, j] = buffer j's page idx[i]; else buffer j's page idx[i] = pages[i, j].
    `table` [J] from `buffer_table` (or a slice of one: a layer's K and V), `idx` [n] int64 on
    the device, `pages` [n, J, row] contiguous of the buffers' element size, `row` the
    elements of one page of one buffer. Queued on the current stream."""
    n = idx.shape[0]
    if n == 0:
        return
    j = table.shape[0]
    if pages.numel() != n * j * row or not pages.is_contiguous():
        raise ValueError(f"page_copy: pages {tuple(pages.shape)} is not [{n}, {j}, {row}]")
    size = pages.element_size()
    block = min(triton.next_power_of_2(row), max(1, _BLOCK_BYTES // size))
    per_program = max(1, _PROGRAM_BYTES // (row * size))
    _page_copy_kernel[(j, triton.cdiv(n, per_program))](
        table, idx, pages, n, J=j, ROW=row, PAGES=per_program, BLOCK=block, GATHER=gather,
        num_warps=4,
    )  # fmt: skip


def page_copy_reference(
    buffers: list[torch.Tensor], idx: torch.Tensor, pages: torch.Tensor, gather: bool
) -> None:
    """`page_copy` in torch: one index op per buffer. `buffers` are [pages, ...] views whose
    rows are one page."""
    n = idx.shape[0]
    view = pages.view(n, len(buffers), -1)
    for j, b in enumerate(buffers):
        rows = b.view(b.shape[0], -1)
        if gather:
            view[:, j] = rows[idx]
        else:
            rows.index_copy_(0, idx, view[:, j])
