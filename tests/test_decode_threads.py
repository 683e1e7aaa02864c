"""runtime/threads.py: a decode-sized forward runs torch on one thread and gives the count
back after (also when it raises); a prompt keeps torch's threads; ggml's count is the one
torch had at load."""

from __future__ import annotations

import pytest
import torch

from expertcache.runtime.threads import DECODE_TOKENS, DecodeThreads


class Probe(torch.nn.Module):
    """Records torch's thread count inside its forward; raises on request."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def forward(self, input_ids: torch.Tensor, fail: bool = False) -> torch.Tensor:
        self.seen.append(torch.get_num_threads())
        if fail:
            raise RuntimeError("boom")
        return input_ids


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_decode_runs_torch_on_one_thread_and_restores(two_threads):
    model = Probe()
    DecodeThreads.attach(model)
    model(torch.zeros(1, 1, dtype=torch.long))
    model(input_ids=torch.zeros(1, DECODE_TOKENS, dtype=torch.long))
    model(torch.zeros(1, DECODE_TOKENS + 1, dtype=torch.long))    # a prompt: torch's own threads
    assert model.seen == [1, 1, 2]
    assert torch.get_num_threads() == 2


def test_threads_come_back_when_the_forward_raises(two_threads):
    model = Probe()
    DecodeThreads.attach(model)
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.zeros(1, 1, dtype=torch.long), fail=True)
    assert model.seen == [1] and torch.get_num_threads() == 2


def test_ggml_kernels_keep_the_count_torch_had_at_load(two_threads):
    pytest.importorskip("expertcache.quant.ggml")
    from expertcache.runtime.cpudense import GgmlLinear
    layer = GgmlLinear(torch.zeros(64, dtype=torch.uint8), 0, 4, 4, bias=False)  # F32 [4, 4]
    torch.set_num_threads(1)
    assert layer.threads == 2
