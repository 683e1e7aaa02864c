"""The vLLM plug-in's host allocation and pool-size check, without vLLM: a quant method's
``create_weights`` run under a device context still puts the expert tensors on the host,
and a pool larger than the device's free memory fails before it is allocated."""

from __future__ import annotations

import pytest
import torch

from expertcache.vllm.pool import HOST_MARK, check_pool_fits, create_on_host


class FakeMethod:
    """What vLLM's UnquantizedFusedMoEMethod.create_weights does: torch.empty on the ambient device."""

    requires_device_loading = True

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, **_):
        E, H, I = num_experts, hidden_size, intermediate_size_per_partition
        layer.register_parameter("w13_weight", torch.nn.Parameter(torch.empty(E, 2 * I, H), requires_grad=False))
        layer.register_parameter("w2_weight", torch.nn.Parameter(torch.empty(E, H, I), requires_grad=False))
        layer.register_parameter("other", torch.nn.Parameter(torch.empty(3), requires_grad=False))


def test_create_weights_puts_experts_on_the_host_under_a_device_context():
    method, layer = FakeMethod(), torch.nn.Module()
    with torch.device("meta"):  # stands in for vLLM's `with target_device:` on a GPU
        create_on_host(method)
        method.create_weights(layer, num_experts=8, hidden_size=16, intermediate_size_per_partition=4)
    assert layer.w13_weight.device.type == "cpu" and layer.w13_weight.shape == (8, 8, 16)
    assert layer.w2_weight.device.type == "cpu" and layer.w2_weight.shape == (8, 16, 4)
    assert getattr(layer.w13_weight, HOST_MARK) and getattr(layer.w2_weight, HOST_MARK)
    assert method.requires_device_loading is False  # vLLM's loader then repacks them where they are
    plain = torch.nn.Module()
    with torch.device("meta"):
        FakeMethod().create_weights(plain, 8, 16, 4)
    assert plain.w13_weight.device.type == "meta"  # the context would have put them on the device


def test_a_pool_larger_than_free_memory_fails_in_one_line():
    check_pool_fits(100, torch.device("cpu"), free_bytes=100)  # fits exactly
    with pytest.raises(ValueError) as err:
        check_pool_fits(3 * 2**30, torch.device("cuda"), free_bytes=2**30)
    text = str(err.value)
    assert text.startswith("expertcache: the slot pool needs 3.00 GiB on cuda but only 1.00 GiB are free")
    assert "'slots'" in text and "\n" not in text
