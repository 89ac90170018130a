"""The bf16 forms of the C row-wise kernels (kernels/csrc/elementwise.c): bit for bit
the torch references in bf16 (torch.equal, no tolerance) over odd shapes and strides,
the dispatchers' choice of path by dtype, and the engine's greedy tokens in bf16
unchanged when the three ops run on the C kernels instead of the references."""
import pytest
import torch

from fusegen.kernels import native, rms_norm as rms_norm_mod, rotary as rotary_mod
from fusegen.kernels import silu_mul as silu_mul_mod
from fusegen.kernels.rms_norm import rms_norm_native, rms_norm_reference
from fusegen.kernels.rotary import rotary_embedding_native, rotary_embedding_reference
from fusegen.kernels.silu_mul import silu_and_mul_native, silu_and_mul_reference

if native.library() is None:
    pytest.fail("the CPU kernels did not build here; see the warning above", pytrace=False)

BF16 = torch.bfloat16
ROWS = [1, 3, 130]
WIDTHS = [1, 7, 64, 4096 + 3]


def _randn(*shape, seed, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(BF16)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", WIDTHS)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_bf16_is_the_reference_bit_for_bit(rows, hidden, with_residual):
    # x and the residual as rows of wider buffers (row stride > hidden), as slices are.
    x = _randn(rows, hidden + 5, seed=rows * hidden, scale=3.0)[:, :hidden]
    residual = _randn(rows, hidden + 3, seed=hidden)[:, :hidden] if with_residual else None
    weight = _randn(hidden, seed=7)
    got = rms_norm_native(x, weight, 1e-5, residual)
    want = rms_norm_reference(x, weight, 1e-5, residual)
    if with_residual:
        assert torch.equal(got[1], want[1])  # the next residual: x + residual in bf16
        got, want = got[0], want[0]
    assert got.dtype == BF16 and torch.equal(got, want)


def _torch_order_sum(squares, lanes):
    """fp32 sum of a row in the order of ATen's cascade_sum with `lanes`-float vectors
    (8 in its AVX2 kernels, 16 in its AVX-512 ones): the order the C kernel mirrors."""
    n = squares.numel()
    lanes = 1 if n < lanes else lanes
    width, num_vectors = 4 * lanes, n // lanes
    num_steps = num_vectors // 4
    power = max(4, max(num_steps - 1, 1).bit_length() // 4)
    level_step, mask = 1 << power, (1 << power) - 1
    acc = [torch.zeros(width) for _ in range(4)]
    i = 0
    while i + level_step <= num_steps:
        for _ in range(level_step):
            acc[0] = acc[0] + squares[i * width:(i + 1) * width]
            i += 1
        for level in range(1, 4):
            acc[level], acc[level - 1] = acc[level] + acc[level - 1], torch.zeros(width)
            if i & (mask << (level * power)):
                break
    for i in range(i, num_steps):
        acc[0] = acc[0] + squares[i * width:(i + 1) * width]
    for level in range(1, 4):
        acc[0] = acc[0] + acc[level]
    partial = acc[0].view(4, lanes).clone()
    for v in range(num_steps * 4, num_vectors):
        partial[0] = partial[0] + squares[v * lanes:(v + 1) * lanes]
    for k in range(1, 4):
        partial[0] = partial[0] + partial[k]
    if lanes == 1:
        return partial[0, 0]
    total = torch.zeros(())
    for value in [*squares[num_vectors * lanes:], *partial[0]]:
        total = total + value
    return total


@pytest.mark.parametrize("hidden", WIDTHS)
@pytest.mark.parametrize("lanes", [8, 16])
def test_rms_norm_sums_in_torchs_order_for_each_vector_width(monkeypatch, hidden, lanes):
    # torch's sum runs its 8-lane (AVX2) kernel on AVX2 and AVX-512 CPUs alike (its
    # AVX-512 entry is left empty): the emulation is checked against torch at 8 lanes,
    # and the C kernel against the emulation at 8 and 16 lanes. In fp32 (the same
    # algorithm as bf16) the output shows the sum to the last bit.
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(hidden)) * 3
    squares = x.pow(2)
    sums = torch.stack([_torch_order_sum(row, lanes) for row in squares])
    if lanes == 8 and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert torch.equal(sums, squares.sum(-1))
    weight = torch.randn(hidden)
    monkeypatch.setattr(rms_norm_mod, "_SUM_LANES", lanes)
    want = weight * (x * torch.rsqrt(sums[:, None] / hidden + 1e-5))
    assert torch.equal(rms_norm_native(x, weight, 1e-5), want)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("inter", WIDTHS)
def test_silu_mul_bf16_is_the_reference_bit_for_bit(rows, inter):
    x = _randn(rows, 2 * inter + 6, seed=inter + rows, scale=4.0)[:, :2 * inter]  # strided rows
    got = silu_and_mul_native(x)
    assert got.shape == (rows, inter) and torch.equal(got, silu_and_mul_reference(x))


def test_silu_mul_bf16_over_every_bf16_gate():
    # Every finite bf16 value as the gate but the subnormals, against ups of both signs
    # with |up| >= 1 so that no product is subnormal: a thread that flushes subnormals
    # to zero would flush them in the reference as well, and which thread takes which
    # rows is not the test's to fix.
    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(BF16)
    tiny = torch.finfo(BF16).tiny
    gate = gate[gate.isfinite() & ((gate.abs() >= tiny) | (gate == 0))]
    gen = torch.Generator().manual_seed(1)
    sign = torch.randint(0, 2, gate.shape, generator=gen) * 2 - 1
    up = (sign * (1 + 3 * torch.rand(gate.shape, generator=gen))).to(BF16)
    x = torch.stack([gate, up]).T.contiguous().view(-1, 2)  # rows of (gate | up), inter 1
    assert torch.equal(silu_and_mul_native(x), silu_and_mul_reference(x))
    x = torch.cat([gate, up]).view(1, -1)  # one row: torch's vector loop and its tail
    assert torch.equal(silu_and_mul_native(x), silu_and_mul_reference(x))


@pytest.mark.parametrize("tokens", ROWS)
@pytest.mark.parametrize("hq, hkv, d, half", [(8, 4, 64, 32), (4, 1, 32, 16), (6, 2, 80, 40),
                                              (8, 2, 64, 16), (2, 2, 128, 1)])
def test_rotary_bf16_is_the_reference_bit_for_bit(tokens, hq, hkv, d, half):
    # GQA head counts; half < d / 2 is partial rotary (the rest of each head passes).
    positions = torch.randint(0, 300, (tokens,), generator=torch.Generator().manual_seed(d))
    qkv = _randn(tokens, (hq + 2 * hkv) * d, seed=tokens + d, scale=2.0)
    # The engine's table: [max_len, 2 * half] (cos | sin) in the model dtype, chunked.
    cos, sin = _randn(300, 2 * half, seed=half).chunk(2, dim=-1)
    want_q = qkv[:, :hq * d].reshape(tokens, hq, d).clone()
    want_k = qkv[:, hq * d:(hq + hkv) * d].reshape(tokens, hkv, d).clone()
    rotary_embedding_reference(positions, want_q, want_k, cos, sin)
    v_before = qkv[:, (hq + hkv) * d:].clone()
    rotary_embedding_native(positions, qkv[:, :hq * d].view(tokens, hq, d),
                            qkv[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d), cos, sin)
    assert torch.equal(qkv[:, :hq * d].view(tokens, hq, d), want_q)
    assert torch.equal(qkv[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d), want_k)
    assert torch.equal(qkv[:, (hq + hkv) * d:], v_before)  # v untouched


def _count_paths(monkeypatch, module, native_name, reference_name):
    calls = []
    for name in (native_name, reference_name):
        fn = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, _n=name, _f=fn: calls.append(_n) or _f(*a))
    return calls


@pytest.mark.parametrize("dtype, path", [(torch.float32, "native"), (BF16, "native"),
                                         (torch.float16, "reference")])
def test_dispatchers_take_the_c_kernels_for_fp32_and_bf16(monkeypatch, dtype, path):
    monkeypatch.delenv("FUSEGEN_KERNELS", raising=False)
    rms = _count_paths(monkeypatch, rms_norm_mod, "rms_norm_native", "rms_norm_reference")
    silu = _count_paths(monkeypatch, silu_mul_mod, "silu_and_mul_native",
                        "silu_and_mul_reference")
    rot = _count_paths(monkeypatch, rotary_mod, "rotary_embedding_native",
                       "rotary_embedding_reference")
    x = torch.randn(3, 16).to(dtype)
    rms_norm_mod.rms_norm(x, torch.ones(16, dtype=dtype), 1e-6, residual=x.clone())
    silu_mul_mod.silu_and_mul(x)
    cos, sin = torch.randn(8, 8).to(dtype).chunk(2, dim=-1)
    q, k = torch.randn(3, 2, 8).to(dtype), torch.randn(3, 1, 8).to(dtype)
    rotary_mod.rotary_embedding(torch.tensor([1, 2, 3]), q, k, cos, sin)
    assert rms == [f"rms_norm_{path}"] and silu == [f"silu_and_mul_{path}"]
    assert rot == [f"rotary_embedding_{path}"]


def test_rotary_with_fp32_tables_and_bf16_heads_stays_on_the_reference(monkeypatch):
    # The reference rounds an fp32 table to the heads' dtype; the C kernel takes one dtype.
    rot = _count_paths(monkeypatch, rotary_mod, "rotary_embedding_native",
                       "rotary_embedding_reference")
    q, k = torch.randn(2, 2, 8).to(BF16), torch.randn(2, 1, 8).to(BF16)
    cos, sin = torch.randn(4, 8).chunk(2, dim=-1)
    rotary_mod.rotary_embedding(torch.tensor([0, 3]), q, k, cos, sin)
    assert rot == ["rotary_embedding_reference"]


@pytest.mark.parametrize("elsewhere", ["auto", "reference"])
def test_engine_bf16_tokens_unchanged_by_the_c_kernels(llama_dir, monkeypatch, elsewhere):
    # FUSEGEN_KERNELS=`elsewhere` for every other kernel (attention, argmax); only these
    # three ops change path between the two runs, so any difference would be theirs.
    # (All C kernels against all references is not a bf16 identity: attention's C path
    # sums in another order than its reference, and greedy tokens follow near ties.)
    from fusegen.engine import LLM, SamplingParams
    from test_engine_equality import PROMPTS

    monkeypatch.setenv("FUSEGEN_KERNELS", elsewhere)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def generate(use_c: bool):
        for module in (rms_norm_mod, silu_mul_mod, rotary_mod):
            monkeypatch.setattr(module, "use_native", lambda tensor: use_c)
        calls.clear()
        with LLM(str(llama_dir), device="cpu", dtype="bfloat16",
                 max_num_batched_tokens=16) as llm:
            tokens = [out.token_ids for out in llm.generate(PROMPTS, params)]
        assert set(calls) == {"rms_norm_native" if use_c else "rms_norm_reference"}
        return tokens

    calls = _count_paths(monkeypatch, rms_norm_mod, "rms_norm_native", "rms_norm_reference")
    assert generate(use_c=True) == generate(use_c=False)
