"""Kernel selection per rank: the native sm hook, FlashInfer settings, tuned kernel configs.

Submodules import what they need when called; importing this package is cheap.
"""
