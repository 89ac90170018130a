"""Paged attention on CPUs (the shapes are those of `paged_attention.py`).

Decode rows go to the C kernel (`kernels/csrc/paged_decode.c`), which reads each
sequence's KV blocks in place; prefill rows to the C prefill kernel
(`kernels/csrc/paged_prefill.c`, fp32 and bf16), or for what it does not take to torch's
fused attention, one sequence at a time. `paged_attention_rowwise` is the
batch-invariant path: every row a decode of its own position. `paged_attention_reference` is plain torch, for machines without a C
compiler and for tests.
"""
from __future__ import annotations

import ctypes
import functools
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fusegen.kernels import native, use_native


_NATIVE_DECODE = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16",
                  torch.float16: "paged_decode_f16"}
_NATIVE_PREFILL = {torch.float32: "paged_prefill_f32", torch.bfloat16: "paged_prefill_bf16"}


def paged_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *,
                        max_query_len: int, max_seq_len: int, scale: float,
                        sliding_window: int = 0) -> torch.Tensor:
    """CPU path: decode rows through the C kernel (kernels/csrc/paged_decode.c), which
    reads each sequence's blocks in place; prefill rows through the C prefill kernel
    where it takes them, else torch's fused attention, one sequence at a time."""
    out = torch.empty_like(q)
    if max_query_len == 1:  # a pure decode step: every sequence, no index lists
        paged_decode_native(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                            out, scale=scale, sliding_window=sliding_window)
        return out
    split = _per_step(("split", query_start_loc), lambda: _split_rows(query_start_loc))
    starts, query_lens, decode, prefill = split
    if decode is not None:
        paged_decode_native(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                            out, scale=scale, sliding_window=sliding_window, seq_ids=decode)
    if prefill is not None and not paged_prefill_native(q, k_cache, v_cache, block_tables, seq_lens,
                                            query_start_loc, out, prefill, scale=scale,
                                            sliding_window=sliding_window):
        lens = seq_lens.tolist()
        for i, n in enumerate(query_lens):
            if n > 1:
                out[starts[i]:starts[i] + n] = _prefill(
                    q[starts[i]:starts[i] + n], k_cache, v_cache, block_tables[i], lens[i],
                    scale, sliding_window)
    return out


def _split_rows(query_start_loc):
    """(starts, query lengths, decode sequence ids as an int32 tensor or None, prefill
    sequence ids as an int32 tensor or None) of a step."""
    starts = query_start_loc.tolist()
    query_lens = [b - a for a, b in zip(starts, starts[1:])]
    ids = [[i for i, n in enumerate(query_lens) if (n == 1) == decode] for decode in (1, 0)]
    decode, prefill = (torch.tensor(x, dtype=torch.int32) if x else None for x in ids)
    return starts, query_lens, decode, prefill


_step_memo = threading.local()


def _per_step(key: tuple, compute):
    """`compute()`, once for as long as the tensors in `key` are the same objects: every
    layer of a step passes the step's metadata tensors, which nobody changes in place,
    so what is derived from them (index lists, bounds checks) is derived once per step
    instead of once per layer. The memo holds the tensors, so their ids cannot be
    reused while it does, and their version counters, so an in-place change is seen."""
    memo = getattr(_step_memo, "entries", None)
    if memo is None:
        memo = _step_memo.entries = {}
    tag, *tensors = key
    # bumped by any in-place change; inference tensors (the engine's) keep no counter,
    # and the engine never changes a step's metadata in place
    versions = [None if t.is_inference() else t._version for t in tensors]
    hit = memo.get(tag)
    if hit is not None and len(hit[0]) == len(tensors) and hit[1] == versions and \
            all(a is b for a, b in zip(hit[0], tensors)):
        return hit[2]
    value = compute()
    memo[tag] = (tensors, versions, value)
    return value


def paged_decode_native(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, *,
                        scale: float, sliding_window: int = 0, seq_ids=None,
                        num_threads: int | None = None, lse=None) -> torch.Tensor:
    """Decode attention for the sequences `seq_ids` (default: all), each with exactly one
    query row at query_start_loc[i], written into `out` in place. CPU tensors; the C
    kernel must be available (`kernels.native.library()`). `lse` [T, Hq] fp32: each
    computed row's log-sum-exp of its scaled scores written there too (kernels/csrc/lse.h)."""
    assert q.dtype in _NATIVE_DECODE, f"unsupported dtype {q.dtype}"
    failed = _call(_NATIVE_DECODE[q.dtype], q, k_cache, v_cache, block_tables, seq_lens,
                   query_start_loc, out, scale, sliding_window, seq_ids, num_threads, lse)
    if failed:
        raise ValueError(f"the CPU decode kernel takes head_dim <= 256 and block_size <= 256 "
                         f"with num_heads a multiple of num_kv_heads; got head_dim "
                         f"{q.shape[2]}, block_size {k_cache.shape[1]}, {q.shape[1]} heads, "
                         f"{k_cache.shape[2]} KV heads")
    return out


def paged_prefill_native(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
                         seq_ids, *, scale: float, sliding_window: int = 0,
                         num_threads: int | None = None, lse=None, kv_end=None) -> bool:
    """Prefill attention (kernels/csrc/paged_prefill.c) for the sequences `seq_ids`, each
    with its query rows query_start_loc[i]..[i+1] the last of its seq_lens[i] tokens,
    into `out` in place. fp32 or bf16 (computed in fp32, rounded once at the end); False
    (nothing written) for another dtype or a shape the kernel does not take (head_dim not
    a multiple of 32, more than 16 query heads per KV head), which the caller then runs
    another way. `lse` as for paged_decode_native; `kv_end` [B] int32 (with `lse`): where
    each sequence's keys end, its rows keeping their positions (kernels/csrc/lse.h)."""
    name = _NATIVE_PREFILL.get(q.dtype)
    if name is None or seq_ids is None or len(seq_ids) == 0 or not (
            q.dtype == k_cache.dtype == v_cache.dtype == out.dtype):
        return False
    return _call(name, q, k_cache, v_cache, block_tables, seq_lens,
                 query_start_loc, out, scale, sliding_window, seq_ids, num_threads, lse,
                 kv_end) == 0


def _call(name, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, scale,
          sliding_window, seq_ids, num_threads, lse=None, kv_end=None) -> int:
    """Check what the C kernels index unchecked, then call `name` (its `_lse` form
    with `lse`); its return code.
    Every layer of a step makes this call with the step's metadata: what is derived
    from it alone (int32 copies, pointers, the bounds check) is derived once a step."""
    num_heads, head_dim = q.shape[1:]
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if not q.dtype == k_cache.dtype == v_cache.dtype == out.dtype:
        raise AssertionError(f"dtypes q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}, "
                             f"out {out.dtype}")
    q_strides, out_strides = q.stride(), out.stride()
    k_strides, v_strides = k_cache.stride(), v_cache.stride()
    if not (q.is_cpu and out.is_cpu and k_cache.is_cpu and v_cache.is_cpu
            and q_strides[-1] == out_strides[-1] == k_strides[-1] == v_strides[-1] == 1):
        bad = next(label for label, t in (("q", q), ("out", out), ("k_cache", k_cache),
                                          ("v_cache", v_cache))
                   if not t.is_cpu or t.stride(-1) != 1)
        raise AssertionError(f"{bad} must be a CPU tensor with a contiguous head dimension")
    if seq_ids is not None and not isinstance(seq_ids, torch.Tensor):
        seq_ids = torch.as_tensor(seq_ids)
    key = ("args", name, num_blocks, block_size, seq_ids is None, kv_end is None)
    tensors = (block_tables, seq_lens, query_start_loc) + (() if seq_ids is None else (seq_ids,))
    reach = () if kv_end is None else (kv_end,)  # the keys read end there, not at seq_lens
    args = _per_step((key, *tensors, *reach),
                     lambda: _step_args(num_blocks, block_size, block_tables, seq_lens,
                                        query_start_loc, seq_ids, kv_end))
    if args.problem:
        raise IndexError(args.problem)
    if args.num_items == 0:
        return 0
    strides = _strides(q_strides, out_strides, k_strides, v_strides, args.table_stride)
    extra = ()
    if lse is not None:
        if not (lse.dtype == torch.float32 and lse.is_contiguous()
                and lse.shape == q.shape[:2]):
            raise AssertionError(f"lse must be contiguous fp32 {tuple(q.shape[:2])}; got "
                                 f"{lse.dtype} {tuple(lse.shape)}")
        name, extra = name + "_lse", (lse.data_ptr(),)
        if name.startswith("paged_prefill"):
            if kv_end is not None and not (kv_end.dtype == torch.int32
                                           and kv_end.is_contiguous()):
                raise AssertionError(f"kv_end must be contiguous int32; got {kv_end.dtype}")
            extra += (None if kv_end is None else kv_end.data_ptr(),)
    failed = _kernel(name)(
        q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        args.block_tables, args.seq_lens, args.query_start_loc, args.seq_ids, args.num_items,
        num_heads, num_kv_heads, head_dim, block_size, sliding_window, scale, strides,
        num_threads or torch.get_num_threads(), *extra)
    if failed == 2:
        raise MemoryError(f"the CPU attention kernel {name} could not allocate its scratch")
    return failed


@functools.cache
def _kernel(name: str):
    """The C entry point `name`; the `_lse` forms (declared here, beside their only
    caller) take the plain form's arguments and then the log-sum-exp output."""
    fn = getattr(native.library(), name)
    if name.endswith("_lse"):
        more = 2 if name.startswith("paged_prefill") else 1  # the prefill's kv_end too
        fn.argtypes = getattr(native.library(), name[:-4]).argtypes + [ctypes.c_void_p] * more
        fn.restype = ctypes.c_int
    return fn


@functools.lru_cache(maxsize=256)  # a few per model and table width: built once
def _strides(q, out, k_cache, v_cache, table_row: int) -> native.Strides:
    """The kernels' Strides struct of these tensors' strides (ctypes passes it by
    reference where the argument is declared a pointer to it)."""
    return native.Strides(*q[:2], *out[:2], *k_cache[:3], *v_cache[:3], table_row)


@dataclass(frozen=True, slots=True)
class _StepArgs:
    """A step's metadata as the C attention kernels take it: pointers to int32 tensors
    (`keep` holds those tensors), the block tables' row stride, the number of
    sequences to compute, and what is wrong with the tables (None: they fit the cache)."""
    block_tables: int
    seq_lens: int
    query_start_loc: int
    seq_ids: int | None
    table_stride: int
    num_items: int
    problem: str | None
    keep: tuple


def _step_args(num_blocks: int, block_size: int, block_tables, seq_lens, query_start_loc,
               seq_ids=None, kv_end=None) -> _StepArgs:
    block_tables = _int32(block_tables)
    if block_tables.stride(1) != 1:
        raise AssertionError("block_tables rows must be contiguous")
    seq_lens, query_start_loc = _int32(seq_lens).contiguous(), _int32(query_start_loc).contiguous()
    if seq_ids is not None:
        seq_ids = _int32(seq_ids).contiguous()
    num_items = seq_lens.shape[0] if seq_ids is None else seq_ids.shape[0]
    # The C kernels index unchecked: refuse what would read outside the cache.
    # Only the sequences computed are read (cooperative attention's parts share their
    # tables between a decode and a prefill call).
    reach = seq_lens if kv_end is None else kv_end
    read = (block_tables, reach) if seq_ids is None else \
        (block_tables[seq_ids.long()], reach[seq_ids.long()])
    problem = table_bounds_problem(*read, num_blocks, block_size) if num_items else None
    return _StepArgs(block_tables.data_ptr(), seq_lens.data_ptr(), query_start_loc.data_ptr(),
                     None if seq_ids is None else seq_ids.data_ptr(), block_tables.stride(0),
                     num_items, problem, (block_tables, seq_lens, query_start_loc, seq_ids))


def table_bounds_problem(block_tables, seq_lens, num_blocks: int, block_size: int) -> str | None:
    """What the kernels would read outside the cache in these tables and lengths, in
    words (None: nothing); CPU graphs check each replayed step with it too."""
    low, high, longest = int(block_tables.min()), int(block_tables.max()), int(seq_lens.max())
    if longest > block_tables.shape[1] * block_size or not 0 <= low <= high < num_blocks:
        return (f"block tables [{tuple(block_tables.shape)}, ids {low}..{high}] do not cover "
                f"sequences of up to {longest} tokens in a cache of {num_blocks} blocks of "
                f"{block_size}")
    return None


def paged_attention_rowwise(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *,
                            scale: float, sliding_window: int = 0,
                            softcap: float = 0.0) -> torch.Tensor:
    """Batch-invariant attention off CUDA: every query row, prefill rows included, runs
    as a decode of its own position, so its keys are reduced block by block in one
    order whether it came in a whole prompt, a chunk of one, or a decode step. The C
    decode kernel when it is available (and `softcap` is off), else the same per row in
    torch."""
    n = query_start_loc[1:] - query_start_loc[:-1]  # [B] query rows per sequence
    seq_of_row = torch.repeat_interleave(torch.arange(n.shape[0], device=n.device),
                                         n.long())  # [T]
    row_in_seq = torch.arange(q.shape[0], device=q.device) - query_start_loc[seq_of_row]
    # Row j of a sequence with L tokens after the step and n new ones sits at L - n + j.
    row_lens = (seq_lens[seq_of_row] - n[seq_of_row] + row_in_seq + 1).to(torch.int32)
    row_tables = block_tables[seq_of_row]  # [T, W]
    rows = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    out = torch.empty_like(q)
    if use_native(q) and not softcap:
        return paged_decode_native(q, k_cache, v_cache, row_tables, row_lens, rows, out,
                                   scale=scale, sliding_window=sliding_window)
    for r, length in enumerate(row_lens.tolist()):  # no C kernel here: slow, but exact
        out[r:r + 1] = _decode_group(q[r:r + 1], k_cache, v_cache, row_tables[r:r + 1],
                                     [length], scale, sliding_window, softcap)
    return out


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *,
                              max_query_len: int, max_seq_len: int, scale: float,
                              sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Plain torch, and the CPU path: decode rows in one batched pass, prefill rows
    one sequence at a time (a step holds few of those). `softcap` c > 0: scores become
    c * tanh(s / c) before the mask, as transformers' eager attention does it."""
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    query_lens = [b - a for a, b in zip(starts, starts[1:])]
    decode = [i for i, n in enumerate(query_lens) if n == 1]
    if decode:
        rows = [starts[i] for i in decode]
        out[rows] = _decode(q[rows], k_cache, v_cache, block_tables[decode],
                            [lens[i] for i in decode], scale, sliding_window, softcap)
    for i, n in enumerate(query_lens):
        if n > 1:
            out[starts[i]:starts[i] + n] = _prefill(
                q[starts[i]:starts[i] + n], k_cache, v_cache, block_tables[i], lens[i],
                scale, sliding_window, softcap)
    return out


def _gather(cache, block_table, num_tokens):
    # cache [N, bs, Hkv, D], block_table [..., W] -> [..., num_tokens, Hkv, D]
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    blocks = cache[block_table[..., :num_blocks]]  # [..., nb, bs, Hkv, D]
    flat = blocks.flatten(-4, -3) if blocks.dim() == 5 else blocks.flatten(0, 1)
    return flat[..., :num_tokens, :, :]


def _prefill(q, k_cache, v_cache, block_table, seq_len, scale, window, softcap=0.0):
    # q [n, Hq, D]; the sequence's last n tokens. Inputs go to SDPA as 4-D
    # [1, H, len, D]: torch's fused CPU kernel takes 4-D inputs (3-D falls back to the
    # unfused math path, which materialises every score).
    n = q.shape[0]
    k = _gather(k_cache, block_table, seq_len).transpose(0, 1)[None]  # [1, Hkv, L, D]
    v = _gather(v_cache, block_table, seq_len).transpose(0, 1)[None]
    qh = q.transpose(0, 1)[None]  # [1, Hq, n, D]
    if n == seq_len and not window and not softcap:
        o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale,
                                           enable_gqa=True)
    else:
        q_pos = torch.arange(seq_len - n, seq_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
        mask = k_pos <= q_pos
        if window:
            mask &= k_pos > q_pos - window
        o = (_softcapped(qh, k, v, mask, scale, softcap) if softcap else
             F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale,
                                            enable_gqa=True))
    return o[0].transpose(0, 1)


def _softcapped(q, k, v, mask, scale, softcap):
    # q [b, Hq, n, D], k/v [b, Hkv, L, D] with Hq a multiple of Hkv; mask broadcasts to
    # [b, Hq, n, L]. The scores are written out (SDPA cannot cap them), in transformers'
    # eager order: scale, cap, mask, softmax in fp32, back to q's dtype.
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.tanh(q @ k.transpose(-1, -2) * scale / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ v


_DECODE_GROUP = 16  # sequences per batched decode pass: bounds the gathered KV copy
_DECODE_SPREAD = 0.8  # a group's shortest sequence is at least this fraction of its longest


def _decode(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap=0.0):
    # q [B, Hq, D], one query per sequence at position seq_len - 1. Sequences run in
    # groups of similar length, so the padding each group gathers stays small.
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__, reverse=True)
    out = torch.empty_like(q)
    start = 0
    while start < len(order):
        longest, end = seq_lens[order[start]], start + 1
        while (end < len(order) and end - start < _DECODE_GROUP
               and seq_lens[order[end]] >= _DECODE_SPREAD * longest):
            end += 1
        group = order[start:end]
        out[group] = _decode_group(q[group], k_cache, v_cache, block_tables[group],
                                   [seq_lens[i] for i in group], scale, window, softcap)
        start = end
    return out


_workspaces = threading.local()


def _workspace(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A flat buffer reused across calls (one per thread): gathering into fresh memory
    costs a page fault per 4 KiB on every call, several times the copy itself."""
    key = (like.device, like.dtype)
    buffers = getattr(_workspaces, "buffers", None)
    if buffers is None:
        buffers = _workspaces.buffers = {}
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = buffers[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


def _gather_into(cache, block_tables, num_blocks, out):
    # cache [N, bs, Hkv, D], block_tables [b, >= num_blocks] -> out [b, num_blocks * bs, Hkv, D]
    ids = block_tables[:, :num_blocks].reshape(-1).long()
    torch.index_select(cache, 0, ids, out=out.view(-1, *cache.shape[1:]))
    return out


def _decode_group(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap=0.0):
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    num_blocks = -(-max(seq_lens) // block_size)
    shape = (batch, num_blocks * block_size, num_kv_heads, head_dim)
    size = batch * num_blocks * block_size * num_kv_heads * head_dim
    kv = _workspace(2 * size, k_cache)
    k = _gather_into(k_cache, block_tables, num_blocks, kv[:size].view(shape)).transpose(1, 2)
    v = _gather_into(v_cache, block_tables, num_blocks, kv[size:].view(shape)).transpose(1, 2)
    # k, v [b, Hkv, L, D] with L the group's longest length rounded up to a block
    lens = torch.tensor(seq_lens, device=q.device).unsqueeze(1)
    pos = torch.arange(k.shape[2], device=q.device).unsqueeze(0)
    valid = pos < lens  # [b, L]
    if window:
        valid &= pos >= lens - window
    # The query heads sharing a KV head become that head's query rows.
    qg = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    mask = valid[:, None, None, :]
    o = (_softcapped(qg, k, v, mask, scale, softcap) if softcap else
         F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale))
    return o.reshape(batch, num_heads, head_dim)
