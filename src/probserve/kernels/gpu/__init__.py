"""The GPU path's kernels, in Triton: products, norms, RoPE with the cache write, paged
attention, gated activations and the vocabulary's reductions, each with a fixed reduction order
whatever the batch (a row's bits do not depend on the rows beside it). Without a GPU they run
under Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors: how CI tests them."""
