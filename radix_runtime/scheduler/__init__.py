"""The scheduler process: radix tree of KV pages, page allocator, batching. Never imports torch."""
