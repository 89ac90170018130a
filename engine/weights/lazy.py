"""`LazyTensor`: a state-dict entry whose values are read (and dequantized) only when a
torch op uses it; the GGUF reader, the group-quantized and the FP8 checkpoint readers
serve their weights as such entries."""
import torch
from torch.utils._pytree import tree_map_only


class LazyTensor(torch.Tensor):
    """A tensor read (and dequantized) only when a torch op uses it (the loader's
    `.to(...)`, a streaming copy into a staging slot): a GGUF file's tensors, a
    group-quantized checkpoint's linears; shape and dtype are known without reading.
    Each use reads afresh, so a disk-tier layer costs no host memory between steps. It
    lives on the meta device: `.to(device)` always copies, never hands the lazy tensor
    itself to a model."""

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], dtype: torch.dtype, load):
        tensor = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device="meta")
        tensor.load = load  # () -> the tensor's values, a real tensor in `dtype`
        return tensor

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = tree_map_only(LazyTensor, lambda t: t.load(), (args, kwargs or {}))
        return func(*args, **kwargs)

    def __repr__(self) -> str:
        return f"LazyTensor(shape={tuple(self.shape)}, dtype={self.dtype})"
