"""Exact speed paths: the frozen-prefix cache, the prompt KV cache, the top-layer path, grouped attention
and pinned host→device copies. Each changes no result (docs/DECISIONS.md, tests compare them bitwise)."""
