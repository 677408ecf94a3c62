"""Cached frozen prefix vs full forward: one DP per-example-gradient micro-batch, and the one-off build.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_prefix.py [--repeats 5] [--micro-batch 8]``.

Embedded scale: SmolLM2-135M fp32, LoRA (r=16, spectral init) on the last ``--lora-layers`` of 30
layers, the embedded GLUE8 training set. Prints the build time of the prefix cache for every training
example (compute + write, into a fresh folder unless ``--cache-dir``), the reload time, and the
median time of ``PerExampleGradients.compute`` on the same micro-batch in three forms:

* ``full, all logits``: the full forward with the LM head on every position (the loop before the cache);
* ``full, supervised logits``: the full forward, LM head only where a label is read (token path now);
* ``cached prefix``: the top layers replayed from the cache, supervised logits only.

It also prints the largest loss / gradient differences of the cached form against the first.
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from prism.data import build_suite
from prism.data.prompts import collate, tokenize_example
from prism.fastpath.prefix import PrefixCache, prefix_depth
from prism.models import attach_lora, load_backbone
from prism.privacy.per_example import PerExampleGradients, per_example_loss

SUITE = {"name": "glue8", "scale": "embedded", "family": "glue", "train_on_inputs": False, "cutoff_len": 384,
         "embedded": {}}
LORA = {"r": 16, "alpha": 16, "dropout": 0.0, "targets": ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"]}


def all_logits_loss_fn(batch: dict[str, Tensor]) -> Callable[[nn.Module], Tensor]:
    """The pre-cache token path: LM head on every position, then :func:`per_example_loss`."""
    def loss_fn(model: nn.Module) -> Tensor:
        model.train()
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        return per_example_loss(logits, batch["labels"], batch["attention_mask"])
    return loss_fn


def timed(fn: Callable[[], tuple[Tensor, dict[str, Tensor]]], repeats: int) -> tuple[float, tuple]:
    """Median seconds over ``repeats`` calls after one warm-up, and the last result."""
    result = fn()
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - tic)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--lora-layers", type=int, default=4)
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: a fresh temporary folder")
    args = parser.parse_args()
    torch.set_num_threads(1)
    backbone = {"name": "smollm2-135m", "dtype": "float32", "lora_layers": args.lora_layers}
    model, tokenizer = load_backbone(backbone, torch.device("cpu"))
    model = attach_lora(model, LORA, backbone, init="spectral", generator=torch.Generator().manual_seed(0))
    suite = build_suite(SUITE, 0)
    features = [tokenize_example(tokenizer, ex, suite.cutoff_len, suite.train_on_inputs) for ex in suite.train]
    lengths = [len(f["input_ids"]) for f in features]
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, smollm2-135m fp32, "
          f"lora_layers={args.lora_layers} -> prefix depth {prefix_depth(model)}; {len(features)} examples, "
          f"{sum(lengths)} tokens (mean {sum(lengths) / len(lengths):.1f}, max {max(lengths)})")

    with tempfile.TemporaryDirectory() as tmp:
        cache_dir = args.cache_dir or Path(tmp)
        tic = time.perf_counter()
        cache = PrefixCache.build(model, features, cache_dir=cache_dir, name="smollm2-135m")
        total = time.perf_counter() - tic
        print(f"build: {total:.1f} s in all ({cache.build_seconds:.1f} s computing states; "
              f"{cache.build_seconds / len(features) * 1e3:.0f} ms/example), "
              f"{sum(s.numel() * s.element_size() for s in cache.states) / 2**20:.0f} MiB")
        tic = time.perf_counter()
        PrefixCache.build(model, features, cache_dir=cache_dir, name="smollm2-135m")
        print(f"reload (key hash + sha256 check + read): {time.perf_counter() - tic:.2f} s")

        indices = sorted(random.Random(0).sample(range(len(features)), args.micro_batch))
        tokens = collate([features[i] for i in indices], pad_id=tokenizer.pad_token_id)
        engine = PerExampleGradients(model)
        forms = {
            "full, all logits": lambda: engine.compute(loss_fn=all_logits_loss_fn(tokens)),
            "full, supervised logits": lambda: engine.compute(**tokens),
            "cached prefix": lambda: engine.compute(**cache.batch(indices)),
        }
        print(f"DP per-example gradients, micro-batch of {args.micro_batch} (padded length "
              f"{tokens['input_ids'].shape[1]}), median of {args.repeats}:")
        results = {}
        for name, fn in forms.items():
            seconds, results[name] = timed(fn, args.repeats)
            print(f"  {name:<24} {seconds:7.3f} s")
        (ref_losses, ref_grads), (losses, grads) = results["full, all logits"], results["cached prefix"]
        grad_err = max(((grads[n] - g).norm() / g.norm()).item() for n, g in ref_grads.items())
        print(f"cached vs full: max |Δloss| {(losses - ref_losses).abs().max().item():.2e}, "
              f"max relative ‖Δgrad‖ per tensor {grad_err:.2e}")


if __name__ == "__main__":
    main()
