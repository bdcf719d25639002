"""The transformers integration under the name the README documents (`gds_gather.hf.from_pretrained`); it lives in
gds_gather.integrations.transformers."""
from .integrations.transformers import from_pretrained, offload_per_layer_embeddings

__all__ = ["from_pretrained", "offload_per_layer_embeddings"]
