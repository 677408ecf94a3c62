"""The paper's mechanism: the tangent-space geometry (eqs. 3–26), the adaptive rank-space moments, and
the peft ↔ paper notation of the LoRA factors (docs/ARCHITECTURE.md)."""
