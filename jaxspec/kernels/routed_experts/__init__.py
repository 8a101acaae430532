"""Routed experts of a MoE layer: XLA reference and Pallas Mosaic GPU grouped-expert kernels."""

from jaxspec.kernels.routed_experts.api import routed_experts

__all__ = ["routed_experts"]
