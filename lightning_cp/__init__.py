"""Context parallelism for PyTorch Lightning."""
