"""Evidence about the DP mechanism, not training: step-level audit statistics, one-run ε lower bounds,
white-box gradient canaries and the mechanism diagnostics (Table 1, Figs. 1–4, 8–15)."""
