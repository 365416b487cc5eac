"""Draft heads trained for the embedded model: files only (docs/benchmarks.md says how)."""
