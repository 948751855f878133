"""SlotCache: appends in place, keeps exactly the committed slots, and shares one storage when layers allow."""

from __future__ import annotations

import gc
import weakref

import torch

from decoding.forward.kv_cache import SlotCache


def _fill(cache: SlotCache, keys: list[torch.Tensor], values: list[torch.Tensor], partly: bool = False) -> None:
    """Append one step's keys and values to every layer (to the first ``len(keys)`` layers when ``partly``)."""
    for layer, key, value in zip(cache.layers, keys, values, strict=not partly):
        layer.update(key, value)


def _random_step(layers: int, tokens: int, key_dim: int = 4, value_dim: int = 4, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    keys = [torch.randn(1, 2, tokens, key_dim, generator=generator) for _ in range(layers)]
    values = [torch.randn(1, 2, tokens, value_dim, generator=generator) for _ in range(layers)]
    return keys, values


def test_a_commit_keeps_the_prefix_then_the_sources_in_every_layer():
    cache = SlotCache(3, 16)
    keys, values = _random_step(3, 9)
    _fill(cache, keys, values)
    cache.commit(4, [6, 8])
    assert cache.length == 6
    for layer, key, value in zip(cache.layers, keys, values, strict=True):
        assert torch.equal(layer.keys, key[:, :, [0, 1, 2, 3, 6, 8]])
        assert torch.equal(layer.values, value[:, :, [0, 1, 2, 3, 6, 8]])


def test_layers_of_one_shape_share_one_storage_and_others_keep_their_own():
    shared = SlotCache(3, 16)
    _fill(shared, *_random_step(3, 2))
    assert shared._in_storage == 3
    assert all(layer._key_buffer.data_ptr() != layer._value_buffer.data_ptr() for layer in shared.layers)
    mixed = SlotCache(2, 16)  # values wider than keys: no shared storage, the per-layer commit
    keys, values = _random_step(2, 5, key_dim=4, value_dim=6)
    _fill(mixed, keys, values)
    assert mixed._in_storage == 0
    mixed.commit(1, [3])
    assert torch.equal(mixed.layers[1].values, values[1][:, :, [0, 3]])


def test_an_in_place_commit_only_shortens_and_appends_continue_after_it():
    cache = SlotCache(2, 16)
    keys, values = _random_step(2, 6)
    _fill(cache, keys, values)
    cache.commit(3, [3, 4])
    more_keys, more_values = _random_step(2, 2, seed=1)
    _fill(cache, more_keys, more_values)
    assert cache.length == 7
    expected = torch.cat([keys[0][:, :, :5], more_keys[0]], dim=2)
    assert torch.equal(cache.layers[0].keys, expected)


def test_a_dropped_cache_is_freed_at_once_without_the_garbage_collector():
    """No reference cycle: the server frees an aborted request's KV memory when it drops the cache."""
    gc.disable()
    try:
        for layers_run in (0, 1, 3):  # never used, partly initialized, fully initialized
            cache = SlotCache(3, 16)
            keys, values = _random_step(3, 2)
            _fill(cache, keys[:layers_run], values[:layers_run], partly=True)
            dead = weakref.ref(cache)
            del cache
            assert dead() is None, f"a cache with {layers_run} layers run outlived its last reference"
    finally:
        gc.enable()
