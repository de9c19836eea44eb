"""kernels/page_copy.py's torch reference (the CUDA kernel is checked against it in
tests/gpu/test_hicache_gpu.py): a gather into page-major rows and a scatter back."""

from __future__ import annotations

import torch

from radix_runtime.worker.kernels.page_copy import page_copy_reference


def test_gather_then_scatter_moves_each_buffers_pages():
    torch.manual_seed(0)
    buffers = [torch.randn(10, 4, 2, 8) for _ in range(6)]  # [pages, page_size, heads, dim]
    idx = torch.tensor([7, 2, 5])
    pages = torch.empty(3, 3, 2, 4, 2, 8)  # [n, layers, K/V, page...]: J = 6 rows per page
    page_copy_reference(buffers, idx, pages, gather=True)
    for j, b in enumerate(buffers):  # row j of page i is buffer j's page idx[i]
        assert torch.equal(pages.view(3, 6, 4, 2, 8)[:, j], b[idx])
    before = [b.clone() for b in buffers]
    page_copy_reference(buffers, torch.tensor([1, 8, 0]), pages, gather=False)
    for b, old in zip(buffers, before):
        assert torch.equal(b[[1, 8, 0]], old[idx])
        assert torch.equal(b[[2, 3, 4, 5, 6, 7, 9]], old[[2, 3, 4, 5, 6, 7, 9]])
