"""The loader's cached name map (loaders/gguf.py ``one_name_map``) leans on transformers'
internals: ``get_gguf_hf_weights_map`` fetches ``gguf.get_tensor_name_map`` at each of its
recursive calls. Pinned here: with the cache, gguf-py builds the map once and the result is the
same as without it."""

import gguf
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

from expertcache.loaders.gguf import one_name_map
from gguf_models import tiny_model


def _names(model):
    processor = TENSOR_PROCESSORS.get("qwen3moe", TensorProcessor)(config=model.config.to_dict())
    return get_gguf_hf_weights_map(model, processor, model_type="qwen3moe")


def test_name_map_is_built_once_and_maps_the_same(monkeypatch):
    model = tiny_model("qwen3_moe")
    built = []
    original = gguf.get_tensor_name_map

    def counting(arch, layers):
        built.append((arch, layers))
        return original(arch, layers)

    monkeypatch.setattr(gguf, "get_tensor_name_map", counting)
    plain = _names(model)
    uncached = len(built)
    built.clear()
    with one_name_map():
        cached = _names(model)
    assert cached == plain
    assert uncached > 1, "transformers builds the map once already: the cache is no longer needed"
    assert len(built) == 1, f"gguf-py's name map built {len(built)} times under the cache"
    assert gguf.get_tensor_name_map is counting  # restored after the block
