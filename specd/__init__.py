"""specd: speculative decoding for MLX language models, split into gRPC services."""

import os

__version__ = "0.1.0"

# transformers serves only tokenizers here; its advice that PyTorch is missing does not apply
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
