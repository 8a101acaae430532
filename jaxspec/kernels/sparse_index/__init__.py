"""Top-k logical token indices -> physical KV-cache slots (GLM-5 / DeepSeek sparse MLA)."""

from jaxspec.kernels.sparse_index.api import convert_topk_to_physical

__all__ = ["convert_topk_to_physical"]
