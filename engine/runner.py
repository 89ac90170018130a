"""The model runner: owns every tensor (weights, the KV block pool, the sampler's
generators) and turns a scheduled batch into sampled tokens."""
from __future__ import annotations

import psutil
import torch

from engine.config import EngineConfig
from engine.loader import load_state_dict
from engine.model import AttentionMetadata, CausalLM
from engine.rope import cos_sin_table
from engine.sampler import Sampler, SamplingBatch
from engine.scheduler import ScheduledBatch

_CPU_KV_FRACTION = 0.3  # of available host memory, when no budget is given
_GPU_KV_FRACTION = 0.85  # of free device memory after the weights


class ModelRunner:
    def __init__(self, config: EngineConfig):
        cfg = config.model_config
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        state = load_state_dict(config.model, cfg, self.dtype, config.allow_pickle)
        self.model = CausalLM(cfg)
        self.model.load({name: t.to(self.device) for name, t in state.items()})
        del state
        self.cos_sin = cos_sin_table(cfg, config.max_model_len, self.dtype, self.device)
        self.num_blocks = self._num_kv_blocks()
        # [layers, k|v, blocks, block_size, kv_heads, head_dim]
        self.kv_cache = torch.zeros(cfg.num_layers, 2, self.num_blocks, self.block_size,
                                    cfg.num_kv_heads, cfg.head_dim, dtype=self.dtype,
                                    device=self.device)
        self.sampler = Sampler(self.device, config.seed)
        self._generators: dict[int, torch.Generator] = {}

    @property
    def kv_block_bytes(self) -> int:
        cfg = self.config.model_config
        elem = torch.finfo(self.dtype).bits // 8
        return 2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * elem

    def _num_kv_blocks(self) -> int:
        config = self.config
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        budget = config.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * _GPU_KV_FRACTION)
            else:
                budget = int(psutil.virtual_memory().available * _CPU_KV_FRACTION)
        # More blocks than every running request at full context could use are waste.
        ceiling = config.max_num_seqs * -(-config.max_model_len // self.block_size)
        return max(1, min(budget // self.kv_block_bytes, ceiling))

    def release(self, request_id: int) -> None:
        self._generators.pop(request_id, None)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int | None]:
        """One forward pass over the batch's ragged tokens; a sampled token for each
        request whose last uncomputed token ran, None for the others."""
        bs = self.block_size
        input_ids, positions, slots, seq_lens = [], [], [], []
        query_start = [0]
        sample_rows, sample_reqs = [], []
        for i, (req, n) in enumerate(zip(batch.requests, batch.num_scheduled_tokens)):
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            input_ids += req.token_ids[start:end]
            positions += range(start, end)
            table = req.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            if end == req.num_tokens:
                sample_rows.append(query_start[-1] - 1)
                sample_reqs.append(i)
        width = max(len(r.block_table) for r in batch.requests)
        tables = [r.block_table + [0] * (width - len(r.block_table)) for r in batch.requests]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            block_tables=self._tensor(tables, torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            query_start_loc=self._tensor(query_start, torch.int32),
            max_query_len=max(batch.num_scheduled_tokens),
            max_seq_len=max(seq_lens),
        )
        x, residual = self.model(self._tensor(input_ids, torch.int64),
                                 self._tensor(positions, torch.int64), self.cos_sin,
                                 self.kv_cache, meta)
        out: list[int | None] = [None] * len(batch)
        if not sample_rows:
            return out
        rows = self._tensor(sample_rows, torch.int64)
        logits = self.model.logits(x[rows], residual[rows])
        reqs = [batch.requests[i] for i in sample_reqs]
        sampling = SamplingBatch([r.params for r in reqs], [self._generator(r) for r in reqs])
        for i, token in zip(sample_reqs, self.sampler(logits, sampling).tolist()):
            out[i] = token
        return out

    def _generator(self, req) -> torch.Generator | None:
        if req.params.seed is None or req.params.temperature == 0.0:
            return None
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = self._generators[req.request_id] = self.sampler.new_generator(req.params.seed)
        return gen

    def _tensor(self, values, dtype) -> torch.Tensor:
        t = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t
