"""Miss paths: where an expert that is not already in a slot gets computed.

- ``fetch``: copy it into a slot (a cache slot the plan assigned, or a staging slot
  for a bypass) and compute on the device with the hits.
- ``cpu``: compute it on the host weights while the device works on the hits; a
  planned load is still copied into its slot (asynchronously) for later hits.
- ``auto``: per missed expert, whichever of the two the cost model
  (``costmodel/``, the simulator's too) says is cheaper for the number of tokens
  routed to it (Fiddler: transfer pays off only when enough tokens use the expert).
"""

from __future__ import annotations

import torch

from .compute import one_expert
from .host import HostExperts


def cpu_experts(module: torch.nn.Module, host: HostExperts, experts: list[int],
                pairs: dict[int, list[tuple[int, int]]], hidden: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
    """Sum of the given experts' outputs on host weights.

    hidden [T, H] and weights [T, K] are host tensors; ``pairs[e]`` lists the (token,
    rank) pairs routed to expert e. Returns [T, H] in hidden's dtype, on the host.
    """
    out = torch.zeros_like(hidden)
    for expert in experts:
        tok, rank = zip(*pairs[expert])
        tok_idx = torch.tensor(tok)
        y = one_expert(module, hidden.index_select(0, tok_idx), host.expert(expert), host.transposed)  # [N, H]
        y = y * weights[tok_idx, torch.tensor(rank)].unsqueeze(-1).to(y.dtype)
        out[tok_idx] += y.to(out.dtype)  # a token meets an expert once: indices are unique
    return out
