"""The continuous-batching engine, its request/step types, workloads and metrics."""
