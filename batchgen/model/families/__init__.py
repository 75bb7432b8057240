"""One module per architecture family, only the math and the checkpoint's names (shapes in
comments); shared building blocks live in :mod:`batchgen.model.layers`:

- ``llama``: Llama, Mistral, Qwen2, Qwen3 (dense);
- ``moe``: the mixture-of-experts decoder and its sparse block, shared by
- ``qwen3_moe``, ``qwen2_moe``, ``mixtral``: one architecture each (config, names).

Each defines the :class:`~batchgen.model.architecture.Architecture` entries that
:mod:`batchgen.model.registry` lists.
"""
