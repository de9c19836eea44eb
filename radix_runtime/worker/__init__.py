"""The worker: weights, the paged KV pool, attention backends and sampling (tensors live only here)."""
