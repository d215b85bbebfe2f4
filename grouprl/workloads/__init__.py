"""Workloads: the seam between the training loop and a modality (base.py)."""
