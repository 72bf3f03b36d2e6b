"""sluice worker: Kafka in, vLLM in the middle, Kafka out."""
