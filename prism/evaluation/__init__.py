"""Evaluation: greedy decoding on the evaluation rows, answer extraction and the Table 2 metrics."""
