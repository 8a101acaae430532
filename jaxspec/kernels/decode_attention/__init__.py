"""Paged multi-row (MTP) decode attention: XLA reference and Pallas Mosaic GPU kernel."""

from jaxspec.kernels.decode_attention.api import paged_decode_attention

__all__ = ["paged_decode_attention"]
