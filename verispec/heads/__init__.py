"""Draft heads trained for the embedded model: files only (docs/drafter-training.md says how)."""
