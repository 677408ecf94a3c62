"""PRISM: gauge-invariant tangent-space differentially private LoRA (arXiv 2606.00944).

The training core. Layers, from the bottom up:

* :mod:`prism.mechanism.geometry` – pure tangent-space math of the fixed-rank manifold (eqs. 11–23).
* :mod:`prism.mechanism.adaptive` – the DP-aware rank-space adaptive transform (eqs. 24–27).
* :mod:`prism.mechanism.lora` – the one place where peft's (lora_A, lora_B) meet the paper's (A, B).
* :mod:`prism.privacy` – per-example gradients, Poisson sampling, PRV accounting.
* :mod:`prism.methods` – PRISM and the factor-space DP-SGD baselines behind one interface.
* :mod:`prism.models`, :mod:`prism.data`, :mod:`prism.evaluation.evaluate` – backbones, suites, metrics.
* :mod:`prism.train` – the loop.
"""

__version__ = "0.1.0"
