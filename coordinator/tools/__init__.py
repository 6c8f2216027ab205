"""Tools around the product: making test checkpoints (with a tiny trained tokenizer), the
transformers reference the parity tests compare with, the demo, and the cluster.yaml check."""
