"""Objectives specific to denoising-step policies (still pure functions on tensors)."""
