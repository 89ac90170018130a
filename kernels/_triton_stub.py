"""Stand-ins for `triton` and `triton.language` where Triton is not installed (setup.py
installs it on Linux only), so a kernel module still imports and its torch reference
still serves. `kernels._triton_available()` is False there, so no kernel is launched."""
import types


def _jit(fn=None, **kwargs):
    return fn if fn is not None else (lambda f: f)


triton = types.SimpleNamespace(jit=_jit, cdiv=lambda a, b: -(-a // b),
                               next_power_of_2=lambda n: 1 << max(n - 1, 0).bit_length())
tl = types.SimpleNamespace(constexpr=object)
