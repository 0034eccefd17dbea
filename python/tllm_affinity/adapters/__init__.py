"""Opt-in adapters that route existing inference-server hooks to tllm_affinity."""
