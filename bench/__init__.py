"""Benchmarks: multi-turn chat (the headline), a serving rate sweep, and radix tree micro benchmarks.

Run them as scripts (``python bench/multi_turn_chat.py --help``) or as modules
(``python -m bench.multi_turn_chat``).
"""
