"""probserve's own CPU kernels (C++, built on first use for the machine: kernels/build.py).

`invariant.InvariantKernels` holds the row-invariant float32 kernels of `--deterministic`: the
linear layers, RMSNorm, SwiGLU, paged attention and the vocabulary-row reductions (log_softmax,
top-k, entropy), each computing a row's result with the same operations in the same order
whatever else the batch holds. `layers.NativeLayers` runs a model's decoder layers on them in
one call a step.
"""
