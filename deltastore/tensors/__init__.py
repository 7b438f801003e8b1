"""Tensor memory as words: zero-copy integer views of torch tensors, gather / scatter
on CPU or device, tensor-table checks. The only layer below publish/sync that imports
torch."""
