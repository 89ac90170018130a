"""The model runner: owns every tensor (weights in their tiers, the device and host
KV block pools, the sampler's generators) and turns a scheduled batch into sampled
tokens."""
from __future__ import annotations

import functools
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
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
from fusegen.engine.graphs import CpuDecodeGraphs, DecodeGraphs, cpu_graphable
from fusegen.engine.runner_api import LOGITS_CHUNK, Runner
from fusegen.engine.request import PLACEHOLDER
from fusegen.engine.scheduler import ScheduledBatch
from fusegen.engine.step_inputs import StepInputs, step_inputs


def _checkpoint_tensors(config: EngineConfig, dtype: torch.dtype) -> dict:
    """Every weight under its Hugging Face name, none read yet (weights/loader.py): the
    entries kept compressed in `config.quantization`'s form carry it as `.compressed`."""
    return checkpoint_tensors(config.model, config.model_config, dtype, config.quantization,
                              config.options.allow_pickle)


def _like_this_thread(device: torch.device):
    """An initializer giving a new thread this one's intra-op thread count and current
    GPU (both are per thread)."""
    threads = torch.get_num_threads()
    gpu = torch.cuda.current_device() if device.type == "cuda" else None

    def start() -> None:
        torch.set_num_threads(threads)
        if gpu is not None:
            torch.cuda.set_device(gpu)
    return start


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
    supports_async_scheduling = True
    _worker: ThreadPoolExecutor | None = None  # runs the steps, with async scheduling

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
            graphs = DecodeGraphs if self.device.type == "cuda" else CpuDecodeGraphs
            self.graphs = graphs(self, config.max_num_seqs, config.max_model_len)
        self._tokens: deque[list[int | None]] = deque()  # submitted batches' results

    @property
    def streamer(self) -> WeightStreamer | None:
        return self.model.streamer

    def _records_decode_steps(self) -> bool:
        """Recorded decode steps (engine/graphs.py), unless asked not to, for models
        without host syncs in their forward pass, with every layer resident and no KV
        in host memory: CUDA graphs on a GPU outside deterministic mode; on a CPU, CPU
        graphs (engine/cpu_graphs.py) where every kernel of a decode step takes the C
        path, deterministic mode included (a replay makes eager's calls)."""
        options = self.config.options
        if options.enforce_eager or self.model.streamer is not None \
                or self.config.kv_split.cooperative:
            return False
        if self.device.type == "cuda":
            return not options.deterministic and self.model.graphable
        return self.device.type == "cpu" and cpu_graphable(self.model)

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

    def overlap_steps(self) -> None:
        """Asynchronous scheduling: from now on `submit` hands each step to one worker
        thread and returns, so the controller prepares the next step while this one runs
        (torch's kernels and fusegen's release the GIL). A step's placeholder inputs are
        the previous step's sampled ids, which the worker holds: on a CPU they are read
        where they were written; on CUDA the worker (not the controller) waits for them."""
        self._worker = ThreadPoolExecutor(1, "fusegen-step", _like_this_thread(self.device))
        self._previous: dict[int, int] = {}  # id(request) -> its index in the last batch
        self._last: list[int | None] = []  # the last step's tokens, on the worker

    def submit(self, batch: ScheduledBatch) -> None:
        """Take the batch's inputs now (the scheduler moves its requests on once it is
        submitted) and run it: at once, or on the worker thread (`overlap_steps`);
        `collect` hands back its tokens."""
        if self._worker is None:
            self._tokens.append(self.run(batch))
            return
        inputs = step_inputs(batch, self.block_size, self.uses_request_lengths)
        # the rows of tokens still in flight, and their requests' indexes in the previous
        # batch (a request's placeholder is the only token it runs)
        rows = np.flatnonzero(inputs.input_ids == PLACEHOLDER)  # [P]
        owners = np.searchsorted(inputs.query_start, rows, side="right") - 1
        fill = rows, [self._previous[id(batch.requests[i])] for i in owners.tolist()]
        self._previous = {id(req): i for i, req in enumerate(batch.requests)}
        self._tokens.append(self._worker.submit(self._run_after, batch, inputs, fill))

    def _run_after(self, batch: ScheduledBatch, inputs: StepInputs,
                   fill: tuple[np.ndarray, list[int]]) -> list[int | None]:
        """On the worker: the batch, its placeholders filled from the step before it."""
        rows, previous = fill
        if len(rows):
            last = self._last
            inputs.input_ids[rows] = [last[i] for i in previous]
        self._last = self.run(batch, inputs)
        return self._last

    def collect(self) -> list[int | None]:
        tokens = self._tokens.popleft()
        return tokens if self._worker is None else tokens.result()

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, inputs: StepInputs | None = None) -> list[int | None]:
        """One forward pass over the batch's ragged tokens (`inputs`: built already, at
        submit); a sampled token for each request whose last uncomputed token ran, None
        for the others."""
        if inputs is None:
            inputs = step_inputs(batch, self.block_size, self.uses_request_lengths)
        self.swap(inputs.swap_out, to_host=True)
        self.swap(inputs.swap_in, to_host=False)
        self.peak_device_bytes = max(self.peak_device_bytes, self._step_bytes(
            len(inputs.input_ids), len(inputs.sample_rows)))
        # one flag a step: a request still missing prompt logprobs (they need more rows)
        prompt_logprobs = any(
            r.prompt_logprobs is not None and len(r.prompt_logprobs) < r.num_prompt_tokens
            for r in batch.requests)
        if self.graphs is not None and self.graphs.serves(inputs):
            # a decode step of plain greedy rows: the graph holds the head and argmax too,
            # and reading its ids is the step's one host sync
            head = inputs.is_decode and not prompt_logprobs \
                and Sampler.plain_greedy(batch.requests)
            out = self.graphs.run(inputs, head)
            if head:
                return out[0].tolist()  # every request samples, in order
            x, residual = out
        else:
            x, residual = self.forward(inputs)
        if prompt_logprobs:
            record_prompt_logprobs(batch.requests, batch.num_scheduled_tokens,
                                   inputs.query_start.tolist(),
                                   lambda rows: self.model.logits(*self._rows(x, residual, rows)),
                                   LOGITS_CHUNK)
        return self._sample(batch, inputs, x, residual)

    def _sample(self, batch: ScheduledBatch, inputs: StepInputs, x, residual
                ) -> list[int | None]:
        """The sampled rows' tokens, each at its request's index (None elsewhere): the
        ids of every chunk read back in one sync."""
        sample_reqs = inputs.sample_reqs.tolist()
        requests = batch.requests if len(sample_reqs) == len(batch) else \
            [batch.requests[i] for i in sample_reqs]  # the batch's own list where all sample
        parts = []
        # plain greedy rows: their tokens straight from the head, no logits written
        for chunk, ids, logits in self.head_chunks(
                x, residual, inputs.sample_rows,
                lambda chunk: Sampler.plain_greedy(requests[chunk])):
            parts.append(ids if ids is not None else self.sampler.sample(logits, requests[chunk]))
        tokens = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist() if parts else []
        if len(tokens) == len(batch):  # every request samples (a decode step), in order
            return tokens
        out: list[int | None] = [None] * len(batch)
        for i, token in zip(sample_reqs, tokens):
            out[i] = token
        return out

    def head_chunks(self, x, residual, rows, greedy):
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
        [T, h] each; `hidden`: the previous pipeline stage's (x, residual). The step's
        integer inputs reach the device in two copies (int64, int32)."""
        lengths = inputs.request_lengths
        ids, positions, slots = self._tensors(
            (inputs.input_ids, inputs.positions, inputs.slots), np.int64)
        seq_lens, query_start, tables, *num_tokens = self._tensors(
            (inputs.seq_lens, inputs.query_start, inputs.block_tables,
             *(() if lengths is None else (lengths,))), np.int32)
        meta = AttentionMetadata(
            slot_mapping=slots, block_tables=tables, seq_lens=seq_lens,
            query_start_loc=query_start, max_query_len=inputs.max_query_len,
            max_seq_len=int(np.max(inputs.seq_lens)))
        if num_tokens:
            meta.num_tokens = num_tokens[0]
        if self._host_pool is not None and int(np.max(inputs.block_tables)) >= self.num_blocks:
            meta.cooperative = self._cooperative_step(inputs)
        whole = len(self.layer_range) == len(self.model.layers)
        return self.model(ids, positions, self.cos_sin, self.kv_caches, meta,
                          **({} if whole else {"layers": self.layer_range, "hidden": hidden}))

    def _cooperative_step(self, inputs: StepInputs) -> CooperativeStep:
        """A step some of whose requests hold host blocks: each layer's attention split
        between the pools (engine/cooperative.py). Beside a GPU the host part runs on the
        host's cores while the device computes its part; on a CPU the device's cores are
        the host's, so the parts run one after the other, each on every core (two parts
        on half the cores each wait on the larger one)."""
        split = split_step(np.asarray(inputs.block_tables).tolist(),
                           np.asarray(inputs.seq_lens).tolist(),
                           np.asarray(inputs.query_start).tolist(),
                           np.asarray(inputs.slots).tolist(), self.num_blocks,
                           self.kv_split.device_quota, self.block_size,
                           self.config.options.deterministic)
        threads = torch.get_num_threads()
        pool = None if self.device.type == "cpu" else self._host_pool
        return CooperativeStep(split, self.device, self._host_caches, pool, threads, threads)

    def _rows(self, x, residual, rows):
        if len(rows) == x.shape[0] and rows[-1] == len(rows) - 1:
            return x, residual  # every row, in order (a decode step): nothing to gather
        index = self._tensor(rows, torch.int64)
        return x[index], residual[index]

    def _tensor(self, values, dtype) -> torch.Tensor:
        return self._to_device(torch.as_tensor(values, dtype=dtype))

    def _tensors(self, arrays, dtype) -> list[torch.Tensor]:
        """Arrays as tensors of numpy `dtype` on the device, in their shapes: on a GPU
        packed into one pinned buffer sent in one copy, then viewed apart; on a CPU the
        arrays' own memory where they hold `dtype` already."""
        arrays = [np.asarray(a, dtype=dtype) for a in arrays]
        if self.device.type != "cuda":
            return [torch.from_numpy(a) for a in arrays]
        sent = self._to_device(torch.from_numpy(np.concatenate([a.ravel() for a in arrays])))
        return [part.view(a.shape) for part, a in zip(sent.split([a.size for a in arrays]),
                                                      arrays)]

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def reset_streams(self) -> None:
        """After a failed step: no tokens left to collect (steps still on the worker
        finish first), and the weight ring restarted from a clean state."""
        if self._worker is not None:
            wait(self._tokens)
            self._last = []
        self._tokens.clear()
        if self.model.streamer is not None:
            self.model.streamer.reset()

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self.model.streamer is not None:
            self.model.streamer.close()
        if self._host_pool is not None:
            self._host_pool.shutdown()
