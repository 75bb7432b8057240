"""The model's building blocks, each built with its implementation chosen once, at load, from a
:class:`~batchgen.model.layers.backend.LayerBackend` (C kernels, packed GEMMs, or PyTorch):

- ``norm``: RMSNorm;
- ``rotary``: RoPE frequencies, cos/sin tables and the in-place rotation;
- ``activation``: SwiGLU's ``silu(gate) * up``;
- ``linear``: linear layers, plain or with packed weights (oneDNN, MKL, the C kernels' GEMM).
"""
