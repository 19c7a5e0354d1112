"""Shared layers the families are built from: norms, rotary embeddings, attention backends, linear
layers (torch and packed native), multi-head latent attention, the dense MLP and the mixture of
experts; :mod:`.kernels` is the
load-time choice between the native and torch implementations, :mod:`.native_ops` the model's only
door to the C++ extension."""
