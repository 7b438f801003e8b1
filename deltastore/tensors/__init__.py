"""Tensor memory as words: zero-copy integer views of tensors, gather / scatter on the host
or a device, tensor-table checks. The layer below publish/sync that knows torch tensors; it
also takes torch-free :class:`~deltastore.tensors.host.HostTensor` s (numpy words, a dtype
name, a shape) and imports torch only when handed a torch tensor or asked for torch dtypes."""
