"""Training for Medusa heads: run config, data pipeline, self-distillation and the Accelerate training loop."""
