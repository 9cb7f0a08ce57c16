"""fedllm: federated fine-tuning of LoRA adapters for causal LMs."""

__version__ = "0.1.0"
