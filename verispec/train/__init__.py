"""Training of learned drafters (EAGLE / Medusa heads) by self-distillation."""
