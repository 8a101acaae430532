"""Kernels: pure functions on arrays, each with a Pallas Mosaic GPU and an XLA path."""

from jaxspec.kernels.decode_attention.api import paged_decode_attention
from jaxspec.kernels.routed_experts.api import routed_experts
from jaxspec.kernels.sparse_index.api import convert_topk_to_physical

__all__ = ["convert_topk_to_physical", "paged_decode_attention", "routed_experts"]
