"""GGUF MoE models: header (torch-free) and loader."""
