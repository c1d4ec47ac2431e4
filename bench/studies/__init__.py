"""The studies: each answers one question with the harness (``bench/harness/``), one module each
(Table 3, a layer and a training-step half, is the subpackage ``table3``).

:data:`STUDIES` is what ``fastmoe-bench --help`` lists. A study that is a mode of the layer benchmark
runs with its flag (``fastmoe-bench --table3``); the others have a ``main(argv)`` of their own and run
as ``fastmoe-bench NAME [options]`` (``python -m bench NAME`` in the checkout; ``NAME --help`` for
their options).
"""
from __future__ import annotations

from typing import NamedTuple


class Study(NamedTuple):
    name: str  #: the module under bench/studies/, and the subcommand of a study run by its own main
    run: str | None  #: how to run it: a flag of the layer benchmark, or None for ``fastmoe-bench NAME``
    measures: str  #: one line


STUDIES = (
    Study("demo", "--demo", "a first number in under a minute: one Mula-7B-A1B layer slice, fastmoe against "
                            "transformers' grouped_mm, beside the GEMM-only bound (make demo)"),
    Study("table3", "--table3 [--quick]", "the published Table 3, layer to training step, for the four Mula "
                                          "models, each measured row above the published one"),
    Study("families", "--family NAME", "one experts layer of qwen3_moe, gpt_oss or mixtral at its published "
                                       "shape: the family's eager and grouped_mm against fastmoe; with "
                                       "--family-models [NAME ...], whole tiny models of each family instead"),
    Study("practitioners", "--shapes practitioners", "one MoE layer at the shapes published MoE kernels compare "
                                                     "on, in TFLOP/s, beside a dense mm of the same FLOPs"),
    Study("compiled", "--compile", "whole-model forward+backward, eager against torch.compile, compile time apart"),
    Study("stages", "--mode stages", "where fastmoe's time goes, launcher by launcher, next to the GEMM-only "
                                     "bound"),
    Study("precision", None, "convergence and training speed of the expert-GEMM precisions (int8, fp8, bf16, "
                             "bf16-sr) on one seed and data; --layer: one layer's time"),
    Study("lora", None, "one LoRA fine-tuning step of a family's experts layer with PEFT's adapters, "
                        "grouped_mm against fastmoe"),
    Study("saved", None, "bytes one MoE layer saves for backward at the Mula shapes, and what saving less "
                         "costs in time"),
    Study("traffic", None, "memory traffic and launches of the fused layer's passes at a real shape, counted "
                           "on the meta device (no GPU)"),
    Study("fp8_recipes", None, "the two fp8 recipes (per-channel, 128-blocks) against full precision, output "
                               "and every gradient, with an outlier column in x"),
    Study("decode_weights", None, "quantized decoding: the expert weights quantized on every call against once "
                                  "(fastmoe_xpu.frozen_expert_weights), beside full precision"),
    Study("audit", None, "kernel launches and host synchronisations of one MoE layer, forward and backward"),
    Study("engine_choice", None, "the auto GEMM-engine choice under a wrong cached choice and under load"),
    Study("small_shapes", None, "where the small-layer path pays: transformers, the staged chain and the padded "
                                "experts op, side by side"),
    Study("generate", None, "model.generate (greedy) of two-layer Qwen3-MoE, Mixtral and OLMoE models: fastmoe "
                            "against transformers' grouped_mm and batched_mm, fp32, bf16 and int8, tokens checked"),
    Study("op_overhead", None, "what one differentiable custom op costs per forward+backward, by registration "
                               "style"),
)

#: the studies run as ``fastmoe-bench NAME``: each module's ``main(argv)``
SUBCOMMANDS = tuple(s.name for s in STUDIES if s.run is None)
