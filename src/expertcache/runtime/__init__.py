"""The only code that allocates or copies tensors: host experts, the slot pool, the
per-layer experts function and the miss paths. It executes SlotTable plans and never
decides what to evict."""
