"""The model runner: owns every tensor (weights in their tiers, the device and host
KV block pools, the sampler's generators) and turns a scheduled batch into sampled
tokens."""
from __future__ import annotations

from collections import Counter

import psutil
import torch

from fusegen.engine.config import EngineConfig
from fusegen.engine.errors import EngineConfigError
from fusegen.engine.weights.loader import load_state_dict
from fusegen.engine.model import AttentionMetadata, CausalLM, fuse, layer_sources
from fusegen.engine.memory.offload import WeightStreamer
from fusegen.engine.memory.placement import BudgetTooSmall, ModelSizes, parse_bytes, plan_placement
from fusegen.engine.rope import cos_sin_table
from fusegen.engine.sampler import Sampler, SamplingBatch
from fusegen.engine.scheduler import ScheduledBatch

_CPU_KV_FRACTION = 0.3  # of available host memory for KV, when no budget is given
_GPU_FREE_FRACTION = 0.9  # of free device memory, when no device budget is given
_HOST_FRACTION = 0.5  # of available host memory for the host tier, when not given
# Sampled rows go through the LM head and the sampler this many at a time, so the
# logits of a 1024-request decode step never exist at once: the activation reserve
# counts at most this many [vocab] rows whatever max_num_seqs is.
LOGITS_CHUNK = 256


class ModelRunner:
    def __init__(self, config: EngineConfig):
        cfg = config.model_config
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        self.memory: dict[str, Counter] = {"device": Counter(), "host": Counter(),
                                           "disk": Counter()}
        state = load_state_dict(config.model, cfg, config.allow_pickle)  # memory-mapped
        self.plan = self._plan(state)
        self.model = CausalLM(cfg)
        self.model.load_fixed(state, self.device, self.dtype)
        self._account("device", "weights", self.model.embed, self.model.norm,
                      self.model.lm_head)
        self._place_layers(state)
        self.cos_sin = cos_sin_table(cfg, config.max_model_len, self.dtype, self.device)
        self.num_blocks = self.plan.num_device_kv_blocks
        self.num_host_blocks = self.plan.num_host_kv_blocks
        # [layers, k|v, blocks, block_size, kv_heads, head_dim]
        shape = (cfg.num_layers, 2, self.num_blocks, self.block_size, cfg.num_kv_heads,
                 cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.host_kv_cache = torch.zeros((*shape[:2], self.num_host_blocks, *shape[3:]),
                                         dtype=self.dtype, pin_memory=self._pin)
        self._account("device", "kv_cache", self.kv_cache)
        self._account("host", "kv_cache", self.host_kv_cache)
        self.sampler = Sampler(self.device, config.seed)
        self._generators: dict[int, torch.Generator] = {}
        self.peak_device_bytes = sum(self.memory["device"].values())

    @property
    def _pin(self) -> bool:
        return self.device.type == "cuda"

    # -- placement --------------------------------------------------------------

    def _sizes(self, state) -> ModelSizes:
        return model_sizes(self.config, state)

    def _plan(self, state):
        config = self.config
        unset = [f for f in ("max_num_seqs", "max_num_batched_tokens")
                 if getattr(config, f) is None]
        config.resolve_limits(streaming=False)
        try:
            plan = self._plan_once(state)
        except BudgetTooSmall as exc:
            raise EngineConfigError(str(exc)) from None
        if plan.streamed_layers and unset:
            # Streaming: larger default batches amortise the transfers (a larger
            # activation reserve too, so plan again; keep the first plan if that
            # no longer fits).
            kept = {f: getattr(config, f) for f in unset}
            for f in unset:
                setattr(config, f, None)
            config.resolve_limits(streaming=True)
            try:
                plan = self._plan_once(state)
            except BudgetTooSmall:
                for f, value in kept.items():
                    setattr(config, f, value)
        return plan

    def _plan_once(self, state):
        config = self.config
        sizes = self._sizes(state)
        on_gpu = self.device.type == "cuda"
        device_free = torch.cuda.mem_get_info(self.device)[0] if on_gpu else \
            psutil.virtual_memory().available
        host_free = psutil.virtual_memory().available
        if config.device_memory is not None:
            budget = self._parse(config.device_memory, device_free, "device_memory")
        else:
            # No limit: all weights on the device; KV gets its own budget.
            weights = sizes.fixed_bytes + sizes.num_layers * sizes.layer_bytes
            if config.kv_cache_memory is not None:
                kv = config.kv_cache_memory
            elif config.num_kv_blocks is not None:
                kv = config.num_kv_blocks * sizes.kv_block_bytes
            elif on_gpu:
                kv = int(device_free * _GPU_FREE_FRACTION) - weights - sizes.activation_bytes
            else:
                kv = int(device_free * _CPU_KV_FRACTION)
            kv = max(kv, sizes.min_kv_blocks * sizes.kv_block_bytes)
            budget = weights + sizes.activation_bytes + kv
        if config.host_memory is not None:
            host = self._parse(config.host_memory, host_free, "host_memory")
        elif on_gpu or config.device_memory is not None:
            host = int(host_free * _HOST_FRACTION)
        else:
            host = 0  # CPU with no device limit: nothing to spill to
        ceiling = config.max_num_seqs * sizes.min_kv_blocks
        host_cap = ceiling if config.num_host_kv_blocks is None else config.num_host_kv_blocks
        # Under a device budget, kv_cache_memory is the KV share kept before layers are
        # placed (the plan's default share otherwise).
        kv_reserve = config.kv_cache_memory if config.device_memory is not None else None
        plan = plan_placement(sizes, budget, host, config.prefetch_depth,
                              kv_reserve=kv_reserve,
                              max_kv_blocks=config.num_kv_blocks or ceiling,
                              max_host_kv_blocks=host_cap)
        if config.host_memory is None and config.num_host_kv_blocks is None:
            # Unasked-for swap space: as much as the device pool, no more (pinned
            # memory is slow to allocate and taken from everyone else).
            plan.num_host_kv_blocks = min(plan.num_host_kv_blocks, plan.num_device_kv_blocks)
            plan.host_bytes["kv_cache"] = plan.num_host_kv_blocks * sizes.kv_block_bytes
        return plan

    @staticmethod
    def _parse(value, free: int, name: str) -> int:
        try:
            return parse_bytes(value, free, name)
        except ValueError as exc:
            raise EngineConfigError(str(exc)) from None

    def _place_layers(self, state) -> None:
        cfg = self.config.model_config
        streamed: dict[int, dict[str, list[torch.Tensor]]] = {}
        for i, (layer, tier) in enumerate(zip(self.model.layers, self.plan.layer_tiers)):
            sources = layer_sources(state, i, cfg)
            if tier == "device":
                weights = fuse(sources, self.device, self.dtype)
                layer.set_weights(weights)
                self._account("device", "weights", *weights.values())
            elif tier == "host":
                weights = fuse(sources, "cpu", self.dtype)
                if self._pin:
                    weights = {n: t.pin_memory() for n, t in weights.items()}
                streamed[i] = {n: [t] for n, t in weights.items()}
                self._account("host", "weights", *weights.values())
            else:  # disk: memory-mapped checkpoint tensors, converted while copied
                streamed[i] = sources
                self.memory["disk"]["weights"] += sum(
                    t.numel() for parts in sources.values() for t in parts
                ) * self.dtype.itemsize
        if streamed:
            self.model.streamer = WeightStreamer(self.model.layers, streamed,
                                                 self.plan.num_staging_slots, self.device,
                                                 self.dtype)
            for slot in self.model.streamer.slots:
                self._account("device", "staging", *slot.values())

    def _account(self, tier: str, use: str, *tensors) -> None:
        self.memory[tier][use] += sum(t.numel() * t.element_size() for t in tensors
                                      if t is not None)

    def memory_report(self) -> dict:
        """Bytes per tier and use, as allocated (counted from the tensors), the
        budgets, and the device peak."""
        device = dict(self.memory["device"])
        report = {
            "device": {**device, "total": sum(device.values()),
                       "budget": self.plan.device_budget},
            "host": {**dict(self.memory["host"]), "budget": self.plan.host_budget},
            "disk": dict(self.memory["disk"]),
            "layers": {t: self.plan.layer_tiers.count(t) for t in ("device", "host", "disk")},
            "kv_blocks": {"device": self.num_blocks, "host": self.num_host_blocks},
        }
        report["device"]["peak"] = (torch.cuda.max_memory_allocated(self.device)
                                    if self.device.type == "cuda" else self.peak_device_bytes)
        streamer = self.model.streamer
        if streamer is not None:
            report["streamed"] = {"layers": len(streamer.order), "loads": streamer.next_load,
                                  "bytes_per_load": streamer.slot_bytes,
                                  "stall_seconds": streamer.stall_seconds}
        return report

    def _step_bytes(self, num_tokens: int, num_sampled: int) -> int:
        """Device bytes in use during a step: every tensor allocated at start-up, plus
        the step's activations and logits (the shape-based estimate the plan
        reserves for)."""
        static = sum(self.memory["device"].values())
        return static + activation_bytes(self.config.model_config, num_tokens, num_sampled)

    # -- steps ------------------------------------------------------------------

    def release(self, request_id: int) -> None:
        self._generators.pop(request_id, None)

    def swap(self, pairs: list[tuple[int, int]], to_host: bool) -> None:
        """Copy KV blocks between the pools: (device, host) pairs out, (host, device) in."""
        if not pairs:
            return
        src, dst = (torch.tensor(c, dtype=torch.int64) for c in zip(*pairs))
        if to_host:
            self.host_kv_cache[:, :, dst] = self.kv_cache[:, :, src.to(self.device)].cpu()
        else:
            self.kv_cache[:, :, dst.to(self.device)] = self.host_kv_cache[:, :, src].to(
                self.device, non_blocking=True)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int | None]:
        """One forward pass over the batch's ragged tokens; a sampled token for each
        request whose last uncomputed token ran, None for the others."""
        self.swap(batch.swap_out, to_host=True)
        self.swap(batch.swap_in, to_host=False)
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
        self.peak_device_bytes = max(self.peak_device_bytes,
                                     self._step_bytes(len(input_ids), len(sample_rows)))
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
        for start in range(0, len(sample_rows), LOGITS_CHUNK):
            chunk = slice(start, start + LOGITS_CHUNK)
            rows = self._tensor(sample_rows[chunk], torch.int64)
            logits = self.model.logits(x[rows], residual[rows])
            reqs = [batch.requests[i] for i in sample_reqs[chunk]]
            sampling = SamplingBatch([r.params for r in reqs],
                                     [self._generator(r) for r in reqs])
            for i, token in zip(sample_reqs[chunk], self.sampler(logits, sampling).tolist()):
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

    def reset_streams(self) -> None:
        """After a failed step: restart the weight ring from a clean state."""
        if self.model.streamer is not None:
            self.model.streamer.reset()

    def close(self) -> None:
        if self.model.streamer is not None:
            self.model.streamer.close()


def model_sizes(config: EngineConfig, state: dict | None = None) -> ModelSizes:
    """The byte sizes the placement plan works over, for this config's dtype and limits
    (reads only the checkpoint's headers)."""
    cfg = config.model_config
    if state is None:
        state = load_state_dict(config.model, cfg, config.allow_pickle)
    if config.max_num_seqs is None or config.max_num_batched_tokens is None:
        config.resolve_limits(streaming=False)
    elem = torch.finfo(config.torch_dtype).bits // 8
    layer = sum(t.numel() for parts in layer_sources(state, 0, cfg).values() for t in parts)
    fixed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    kv_block = 2 * cfg.num_layers * config.block_size * cfg.num_kv_heads * cfg.head_dim * elem
    activations = activation_bytes(cfg, config.max_num_batched_tokens, config.max_num_seqs)
    return ModelSizes(layer_bytes=layer * elem, num_layers=cfg.num_layers,
                      fixed_bytes=(fixed + cfg.hidden_size) * elem, kv_block_bytes=kv_block,
                      min_kv_blocks=-(-config.max_model_len // config.block_size),
                      activation_bytes=activations)


def activation_bytes(cfg, num_tokens: int, num_sampled: int) -> int:
    """A step's transient tensors: per token the hidden stream, residual, norms, q/k/v
    and the MLP's gate/up (fp32 at most), and per sampled row (at most LOGITS_CHUNK at
    a time) the logits and the sampler's two working copies."""
    width = (4 * cfg.hidden_size + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
             + 3 * cfg.intermediate_size)
    return num_tokens * width * 4 + min(num_sampled, LOGITS_CHUNK) * cfg.vocab_size * 4 * 3
