"""Model files' headers (torch-free): GGUF MoE files (loading one is ``loaders/gguf.py``) and
safetensors checkpoints' tensor offsets (``safetensors.py``)."""
