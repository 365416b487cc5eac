"""Weights kept as blocks of small integers and multiplied as they are stored (see formats.py
for the block format and kernels.py for which kernel runs)."""
