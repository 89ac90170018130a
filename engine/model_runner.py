"""The model runner: owns every tensor (weights in their tiers, the device and host
KV block pools, the sampler's generators) and turns a scheduled batch into sampled
tokens."""
from __future__ import annotations

import functools
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor

import torch

from fusegen.engine.config import COMPRESSED, EngineConfig
from fusegen.engine.cooperative import CooperativeStep, split_step
from fusegen.engine.host import keep_freed_memory, zeros_lazy
from fusegen.engine.weights.loader import checkpoint_tensors, fuse
from fusegen.engine.models import get_architecture
from fusegen.engine.models.decoder import AttentionMetadata
from fusegen.engine.models.rope import cos_sin_tables
from fusegen.engine.memory.offload import DiskPart, Stream, WeightStreamer
from fusegen.engine.memory.plan import activation_bytes
from fusegen.engine.weights.linear import ROW_TILE
from fusegen.engine.weights.packed import can_pack, pack_linear, pack_linears
from fusegen.engine.weights.quantized import compress_shell, keep_blocks, split_kept
from fusegen.engine.logprobs import record_prompt_logprobs
from fusegen.engine.sampler import Sampler
from fusegen.engine.graphs import DecodeGraphs
from fusegen.engine.runner_api import LOGITS_CHUNK, Runner
from fusegen.engine.scheduler import ScheduledBatch
from fusegen.engine.step_inputs import StepInputs, host_rows, step_inputs


def _checkpoint_tensors(config: EngineConfig, dtype: torch.dtype) -> dict:
    """Every weight under its Hugging Face name, none read yet (weights/loader.py): the
    entries kept compressed in `config.quantization`'s form carry it as `.compressed`."""
    return checkpoint_tensors(config.model, config.model_config, dtype, config.quantization,
                              config.options.allow_pickle)


def _component(source, name: str) -> torch.Tensor:
    """Component `name` of a compressed source, read now (a disk-tier layer's copy)."""
    return source.load()[name]


class ModelRunner(Runner):
    """The whole model in this process. A rank of a device group runs a subclass
    (engine/parallel/worker.py) that holds its slice: the hooks `_model_config`,
    `_build_model`, `_fixed_sources`, `_layer_sources`, `_layer_parts`,
    `_keep_compressed`, `_pack_head` and `layer_range`."""
    max_in_flight = 1  # a batch runs as it is submitted: nothing to overlap it with
    supports_prompt_logprobs = True
    failed = None  # a failed step raises; the next one runs (after reset_streams)

    def __init__(self, config: EngineConfig):
        self.config = config
        cfg = self._model_config()
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        self.memory: dict[str, Counter] = {"device": Counter(), "host": Counter(),
                                           "disk": Counter()}
        if self.device.type == "cpu":
            keep_freed_memory()
        else:  # the device peak counts from here, over what this engine allocates
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_base = torch.cuda.memory_allocated(self.device)
        state = _checkpoint_tensors(config, self.dtype)  # nothing read yet
        self.plan = config.placement
        self.arch = get_architecture(cfg.architecture)
        self.model = self._build_model(cfg)
        self.uses_request_lengths = self.arch.uses_request_lengths(cfg)
        if config.options.deterministic:
            self.model.make_deterministic(ROW_TILE)
        self.model.load_fixed(self._fixed_sources(state), self.device, self.dtype)
        self.memory["device"]["weights"] += self.model.fixed_nbytes
        self._place_layers(state)
        if self.device.type == "cpu" and can_pack(self.dtype):
            self._pack_weights()
        # one table per rotary base (Gemma 3: the sliding-window layers' own)
        self.cos_sin = cos_sin_tables(cfg, config.max_model_len, self.dtype, self.device)
        self.num_blocks = self.plan.num_device_kv_blocks
        self.num_host_blocks = self.plan.num_host_kv_blocks
        # [layers, blocks, k|v, block_size, kv_heads, head_dim]: a block's keys and values
        # side by side, so attention reads each block as one run of memory (on a CPU one
        # run streams near the memory's bandwidth; two half-size runs a block do not)
        shape = (len(self.layer_range), self.num_blocks, 2, self.block_size, cfg.num_kv_heads,
                 cfg.head_dim)
        self.kv_cache = zeros_lazy(shape, self.dtype) if self.device.type == "cpu" else \
            torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.host_kv_cache = torch.zeros((shape[0], self.num_host_blocks, *shape[2:]),
                                         dtype=self.dtype, pin_memory=self._pin)
        # per layer (keys, values), each a [blocks, block_size, kv_heads, head_dim] view;
        # None for the layers another pipeline stage holds
        self.kv_caches = [None] * cfg.num_layers
        for layer, cache in zip(self.layer_range, self.kv_cache):
            self.kv_caches[layer] = cache.unbind(1)
        self._account("device", "kv_cache", self.kv_cache)
        self._account("host", "kv_cache", self.host_kv_cache)
        self.kv_split = config.kv_split
        self._host_pool = None  # cooperative KV: the thread that runs host parts
        if self.kv_split.cooperative:
            self._host_caches = {self.kv_caches[layer][0].data_ptr(): cache.unbind(1)
                                 for layer, cache in zip(self.layer_range, self.host_kv_cache)}
            self._host_pool = ThreadPoolExecutor(1, thread_name_prefix="fusegen-host-kv")
        self.sampler = Sampler(self.device, config.options.seed)
        self.peak_device_bytes = sum(self.memory["device"].values())
        self.graphs = None
        if self._records_decode_steps():
            self.graphs = DecodeGraphs(self, config.max_num_seqs, config.max_model_len)
        self._tokens: deque[list[int | None]] = deque()  # submitted batches' results

    @property
    def streamer(self) -> WeightStreamer | None:
        return self.model.streamer

    def _records_decode_steps(self) -> bool:
        """CUDA graphs for decode steps (engine/graphs.py): on a GPU, unless asked not
        to, for models without host syncs in their forward pass, with every layer
        resident, outside deterministic mode."""
        options = self.config.options
        return (self.device.type == "cuda" and not options.enforce_eager
                and not options.deterministic and self.model.graphable
                and self.model.streamer is None and not self.config.kv_split.cooperative)

    # -- what a rank of a device group holds instead (engine/parallel/worker.py) ----

    @property
    def layer_range(self) -> range:
        return range(self.config.model_config.num_layers)

    def _model_config(self):
        return self.config.model_config

    def _build_model(self, cfg):
        return self.arch.build_model(cfg)

    def _fixed_sources(self, state) -> dict:
        return self.arch.fixed_sources(state, self.config.model_config)

    def _layer_sources(self, state, index: int) -> dict:
        return self.arch.layer_sources(state, index, self.config.model_config)

    def _pack_head(self) -> None:
        # a head kept as its GGUF blocks (weights/quantized_fixed.py) stays as it is
        if self.model.lm_head.weight is not None:
            self.model.lm_head = pack_linear(self.model.lm_head, LOGITS_CHUNK)

    @property
    def _pin(self) -> bool:
        return self.device.type == "cuda"

    # -- placement --------------------------------------------------------------

    def _place_layers(self, state) -> None:
        """Each layer of `layer_range` in its planned tier. A linear kept compressed
        (GGUF blocks, int8 / int4 groups, FP8; weights/quantized.py) is placed, counted and
        streamed as its components (uint8 codes, fp16 scales) in their own dtypes; the
        rest dense in the run's dtype."""
        streamed: dict[int, dict[str, Stream]] = {}
        for i, tier in zip(self.layer_range, self.plan.layer_tiers):
            layer = self.model.layers[i]
            kept, sources = self._layer_parts(state, i)
            if tier == "device":
                compressed = self._keep_compressed(layer, kept, self.device)
                weights = fuse(sources, self.device, self.dtype)
                layer.set_weights(weights)
                self._account("device", "weights", *compressed.values(), *weights.values())
            else:  # its tensors stream into staging slots before each use
                self._keep_compressed(layer, kept, None)
                streamed[i] = self._streams(sources, kept, tier)
                self.memory[tier]["weights"] += sum(s.nbytes for s in streamed[i].values())
        if streamed:
            self.model.streamer = WeightStreamer(self.model.layers, streamed,
                                                 self.plan.num_staging_slots, self.device)
            self._account("device", "staging", *self.model.streamer.buffers)

    def _layer_parts(self, state, index: int) -> tuple[dict, dict]:
        """Layer `index`'s sources as (the parameters kept compressed: CompressedSource
        parts, the rest: tensor parts); a rank narrows both to its slice."""
        sources = self._layer_sources(state, index)
        return split_kept(sources, self.config.device) if self._keeps_blocks else ({}, sources)

    def _keep_compressed(self, layer, kept: dict, device) -> dict[str, torch.Tensor]:
        """Swap `layer`'s Linears in `kept` for compressed ones: holding their components
        on `device` (returned by name, "qkv.blocks"), or, `device` None, empty shells a
        staging slot fills per step."""
        if not kept:
            return {}
        if device is None:
            compress_shell(layer, kept)
            return {}
        return keep_blocks(layer, kept, device)

    def _streams(self, sources: dict, kept: dict, tier: str) -> dict[str, Stream]:
        """A streamed layer's tensors by name. Host tier: copies in host memory (pinned
        on CUDA), dense ones already in the run's dtype; disk tier: the checkpoint's
        tensors (dense ones converted while copied) and the compressed components read
        from the file's memory map at each copy."""
        if tier == "host":
            weights = fuse(sources, "cpu", self.dtype)  # a copy already
            streams = {n: Stream([t.pin_memory() if self._pin else t], self.dtype)
                       for n, t in weights.items()}
        else:
            streams = {n: Stream(list(parts), self.dtype) for n, parts in sources.items()}
        for param, parts in kept.items():
            owner, components = param.rpartition(".")[0], parts[0].components()
            if tier == "host":
                loaded = [part.load() for part in parts]
                columns = {name: [self._host_copy(c[name]) for c in loaded]
                           for name in components}
            else:
                columns = {name: [DiskPart(part.components()[name][1],
                                           functools.partial(_component, part, name))
                                  for part in parts] for name in components}
            streams |= {f"{owner}.{name}": Stream(columns[name], dtype)
                        for name, (dtype, _) in components.items()}
        return streams

    def _host_copy(self, t: torch.Tensor) -> torch.Tensor:
        """`t` copied into host memory this runner owns (pinned on CUDA), never a view
        of the checkpoint's memory map."""
        return t.pin_memory() if self._pin else t.clone(memory_format=torch.contiguous_format)

    @property
    def _keeps_blocks(self) -> bool:
        """Whether the decoder linears with a compressed source stay compressed (GGUF
        blocks, int8 / int4 group codes, FP8: `EngineConfig.quantization`)."""
        return self.config.quantization in COMPRESSED

    def _pack_weights(self) -> None:
        """Resident weights packed once for oneDNN (engine/weights/packed.py); streamed
        layers stay dense, their staging slots refill every step, and GGUFLinears keep
        their blocks (pack_linears packs dense Linears only)."""
        for i, tier in zip(self.layer_range, self.plan.layer_tiers):
            if tier == "device":
                pack_linears(self.model.layers[i], self.config.max_num_batched_tokens)
        self._pack_head()
        if self.config.model_config.tie_word_embeddings:  # the embedding stays dense too
            self._account("device", "weights", self.model.lm_head.weight)

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
            "kv_placement": self.kv_split.placement,
        }
        report["device"]["peak"] = (
            torch.cuda.max_memory_allocated(self.device) - self._cuda_base
            if self.device.type == "cuda" else self.peak_device_bytes)
        streamer = self.model.streamer
        if streamer is not None:
            report["streamed"] = {"layers": len(streamer.order), "loads": streamer.next_load,
                                  "bytes_per_load": streamer.slot_bytes,
                                  "stall_seconds": streamer.stall_seconds}
        return report

    def local_model(self):
        return self.model

    def step_weight_bytes(self) -> int:
        """Every tier's weights but an embedding table that only the lookup reads (the
        head reads a tied table whole where it is the head's own storage)."""
        model = self.model
        total = sum(self.memory[tier]["weights"] for tier in ("device", "host", "disk"))
        table = model.embed_blocks.blocks if model.embed_blocks is not None else model.embed
        head = getattr(model.lm_head, "blocks", None)
        if head is None:
            head = getattr(model.lm_head, "weight", None)
        shared = isinstance(head, torch.Tensor) and not head.is_mkldnn \
            and head.numel() and head.data_ptr() == table.data_ptr()
        return total if shared else total - table.numel() * table.element_size()

    def _step_bytes(self, num_tokens: int, num_sampled: int) -> int:
        """Device bytes in use during a step: every tensor allocated at start-up, plus
        the step's activations and logits (the shape-based estimate the plan
        reserves for)."""
        static = sum(self.memory["device"].values())
        return static + activation_bytes(self.config.shape, num_tokens, num_sampled)

    # -- steps ------------------------------------------------------------------

    def swap(self, pairs: list[tuple[int, int]], to_host: bool) -> None:
        """Copy KV blocks between the pools: (device, host) pairs out, (host, device) in."""
        if not pairs:
            return
        src, dst = (torch.tensor(c, dtype=torch.int64) for c in zip(*pairs))
        if to_host:
            self.host_kv_cache[:, dst] = self.kv_cache[:, src.to(self.device)].cpu()
        else:
            self.kv_cache[:, dst.to(self.device)] = self.host_kv_cache[:, src].to(
                self.device, non_blocking=True)

    def submit(self, batch: ScheduledBatch) -> None:
        """Run the batch now; `collect` hands back its tokens."""
        self._tokens.append(self.run(batch))

    def collect(self) -> list[int | None]:
        return self._tokens.popleft()

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int | None]:
        """One forward pass over the batch's ragged tokens; a sampled token for each
        request whose last uncomputed token ran, None for the others."""
        inputs = step_inputs(batch, self.block_size, self.uses_request_lengths)
        self.swap(inputs.swap_out, to_host=True)
        self.swap(inputs.swap_in, to_host=False)
        self.peak_device_bytes = max(self.peak_device_bytes, self._step_bytes(
            len(inputs.input_ids), len(inputs.sample_rows)))
        if self.graphs is not None and self.graphs.serves(inputs):
            x, residual = self.graphs.run(inputs)
        else:
            x, residual = self.forward(inputs)
        # one flag a step: a request still missing prompt logprobs (they need more rows)
        if any(r.prompt_logprobs is not None and len(r.prompt_logprobs) < r.num_prompt_tokens
               for r in batch.requests):
            record_prompt_logprobs(batch.requests, batch.num_scheduled_tokens,
                                   inputs.query_start,
                                   lambda rows: self.model.logits(*self._rows(x, residual, rows)),
                                   LOGITS_CHUNK)
        out: list[int | None] = [None] * len(batch)

        def requests(chunk: slice) -> list:
            return [batch.requests[i] for i in inputs.sample_reqs[chunk]]

        # plain greedy rows: their tokens straight from the head, no logits written
        for chunk, tokens, logits in self.head_chunks(
                x, residual, inputs.sample_rows,
                lambda chunk: Sampler.plain_greedy(requests(chunk))):
            if tokens is None:
                tokens = self.sampler.sample(logits, requests(chunk))
            for i, token in zip(inputs.sample_reqs[chunk], tokens.tolist()):
                out[i] = token
        return out

    def head_chunks(self, x, residual, rows: list[int], greedy):
        """The head over the sampled `rows` of (x, residual), LOGITS_CHUNK rows at a time
        (a step's logits never exceed a chunk's): per chunk (its slice of `rows`, the
        greedy token ids [n] or None, the fp32 logits [n, V] or None). The ids come where
        `greedy(chunk)` and the head computes its own argmax; the logits otherwise."""
        for start in range(0, len(rows), LOGITS_CHUNK):
            chunk = slice(start, start + LOGITS_CHUNK)
            x_rows, residual_rows = self._rows(x, residual, rows[chunk])
            tokens = self.model.greedy_tokens(x_rows, residual_rows) if greedy(chunk) else None
            yield chunk, tokens, self.model.logits(x_rows, residual_rows) if tokens is None \
                else None

    def forward(self, inputs: StepInputs, hidden=None):
        """The model's layers this process holds over the step's tokens -> (x, residual)
        [T, h] each; `hidden`: the previous pipeline stage's (x, residual)."""
        meta = AttentionMetadata(
            slot_mapping=self._tensor(inputs.slots, torch.int64),
            block_tables=self._to_device(host_rows(inputs.block_tables)),
            seq_lens=self._tensor(inputs.seq_lens, torch.int32),
            query_start_loc=self._tensor(inputs.query_start, torch.int32),
            max_query_len=inputs.max_query_len,
            max_seq_len=max(inputs.seq_lens),
        )
        if inputs.request_lengths is not None:
            meta.num_tokens = self._tensor(inputs.request_lengths, torch.int32)
        if self._host_pool is not None and max(map(max, inputs.block_tables)) >= self.num_blocks:
            meta.cooperative = self._cooperative_step(inputs)
        whole = len(self.layer_range) == len(self.model.layers)
        return self.model(self._tensor(inputs.input_ids, torch.int64),
                          self._tensor(inputs.positions, torch.int64), self.cos_sin,
                          self.kv_caches, meta, **({} if whole else
                                                   {"layers": self.layer_range, "hidden": hidden}))

    def _cooperative_step(self, inputs: StepInputs) -> CooperativeStep:
        """A step some of whose requests hold host blocks: each layer's attention split
        between the pools (engine/cooperative.py). Beside a GPU the host part runs on the
        host's cores while the device computes its part; on a CPU the device's cores are
        the host's, so the parts run one after the other, each on every core (two parts
        on half the cores each wait on the larger one)."""
        split = split_step(inputs.block_tables, inputs.seq_lens, inputs.query_start,
                           inputs.slots, self.num_blocks, self.kv_split.device_quota,
                           self.block_size, self.config.options.deterministic)
        threads = torch.get_num_threads()
        pool = None if self.device.type == "cpu" else self._host_pool
        return CooperativeStep(split, self.device, self._host_caches, pool, threads, threads)

    def _rows(self, x, residual, rows: list[int]):
        if len(rows) == x.shape[0] and rows[-1] == len(rows) - 1:
            return x, residual  # every row, in order (a decode step): nothing to gather
        index = self._tensor(rows, torch.int64)
        return x[index], residual[index]

    def _tensor(self, values, dtype) -> torch.Tensor:
        return self._to_device(torch.tensor(values, dtype=dtype))

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def reset_streams(self) -> None:
        """After a failed step: no tokens left to collect, and the weight ring restarted
        from a clean state."""
        self._tokens.clear()
        if self.model.streamer is not None:
            self.model.streamer.reset()

    def close(self) -> None:
        if self.model.streamer is not None:
            self.model.streamer.close()
        if self._host_pool is not None:
            self._host_pool.shutdown()
