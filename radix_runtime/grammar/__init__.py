"""Constrained decoding: grammars (JSON schema, any JSON, regex, EBNF) compiled by xgrammar into
token masks that the worker applies to the logits before sampling.

Placement: everything that touches xgrammar (it imports torch) lives in the worker process:
`compiler.GrammarCache` compiles on a thread pool and caches by (kind, text);
`matcher.SlotGrammar` holds one request's matcher state. The torch-free scheduler only sees
the (kind, text) key: it asks the worker to compile a request's grammar when the request arrives
(`messages.CompileGrammar`) and admits the request once the worker reports it compiled
(`messages.GrammarCompiled`), so a slow compile never stalls other requests' steps and an
invalid grammar fails its request with a 400 before any output. See docs/structured_output.md.
"""

# grammars the scheduler remembers as compiled on the worker (LRU); the worker's cache holds
# twice as many, so a grammar the scheduler admits a request for is (almost always) still there
SCHEDULER_KNOWN_GRAMMARS = 512
WORKER_CACHED_GRAMMARS = 2 * SCHEDULER_KNOWN_GRAMMARS
