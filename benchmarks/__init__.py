"""Benchmarks of ORTModule against PyTorch eager and torch.compile: ``python -m benchmarks``."""
