"""Data parallelism: N replicas of the whole server (tokenizer + scheduler + worker each) behind
SGLang's router, which spreads requests over them (cache-aware by default).

    supervisor (radix-runtime serve --dp N) ──▶ replica 0 .. N-1 (radix_runtime.dp.replica)
                                            └─▶ router (radix_runtime.dp.router: sglang-router)

The offline `Engine(dp=N)` runs N replicas in-process behind `replica_set.ReplicaSet` instead
(no router). See docs/scaling.md. The router is the optional extra `radix_runtime[router]`.
"""
