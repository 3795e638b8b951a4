"""Runnable example: qwen3 ``debugmodel_moe`` with relibra on CPU ranks (see README.md)."""
