"""Full-size configs build with real shapes and no memory (jax.eval_shape)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspine_jax.config import PRESETS
from dspine_jax.kv_cache import PagedKVCache
from dspine_jax.target import TargetModel

# Parameter counts published on the model cards (embeddings included).
PUBLISHED = {"qwen3-4b": 4.02e9, "qwen3-8b": 8.19e9, "smollm2-135m": 1.35e8}


@pytest.mark.parametrize("name", ["qwen3-4b", "qwen3-8b"])
def test_eval_shape_builds_full_size_qwen3(name):
    config = PRESETS[name]
    abstract = nnx.eval_shape(lambda: TargetModel(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    params = nnx.state(abstract, nnx.Param)
    leaves = jax.tree.leaves(params)
    count = sum(int(np.prod(x.shape)) for x in leaves)
    assert count == config.num_params()
    assert abs(count - PUBLISHED[name]) / PUBLISHED[name] < 0.01
    assert all(x.dtype == jnp.bfloat16 for x in leaves)
    q = abstract.layers[0].self_attn.q_proj.weight
    assert q.shape == (config.num_attention_heads * config.head_dim, config.hidden_size)

    # A decode step with a KV cache and feature layers, traced with no memory either.
    graphdef, state = nnx.split(abstract)
    cache = jax.eval_shape(lambda: PagedKVCache.contiguous(config, 4, 1024, jnp.bfloat16))

    def step(state, tokens, cache):
        return nnx.merge(graphdef, state)(tokens, cache, hidden_layer_ids=(1, 9, 17, 25, 33))

    out = jax.eval_shape(step, state, jax.ShapeDtypeStruct((4, 16), jnp.int32), cache)
    assert out.logits.shape == (4, 16, config.vocab_size)
    assert out.hidden_states.shape == (5, 4, 16, config.hidden_size)
    assert out.cache.k_pages[0].shape == (4 * 1024 // 16, 16, config.num_key_value_heads,
                                           config.head_dim)
