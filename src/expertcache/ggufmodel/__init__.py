"""GGUF MoE files: the header (torch-free). Loading one is ``loaders/gguf.py``."""
