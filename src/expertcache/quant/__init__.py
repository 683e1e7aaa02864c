"""Quantized expert formats. This package root stays torch-free: import the torch code from
`expertcache.quant.dequant` (GGUF block types) and `expertcache.quant.hf` (HF-native layouts)."""

from .formats import SUPPORTED, QuantFormat, check_supported, quant_format

__all__ = ["SUPPORTED", "QuantFormat", "check_supported", "quant_format"]
