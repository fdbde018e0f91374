"""Batch sync: the inputs a baseline's ranks publish per step, held for candidates (docs/records-and-batches.md)."""
