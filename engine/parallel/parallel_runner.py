"""The controller's side of a device group: the engine's runner when
tensor_parallel_size x pipeline_parallel_size > 1.

It holds no weights. Each step it sends the batch's inputs (plain lists) once to every
rank and later collects the step's tokens from the last stage's first rank, or the
sampled rows' logits from shared memory, which it samples with the engine's `Sampler`
and the requests' own state (seeds, penalties, logprobs, grammars), exactly as the
single-process runner does. With P stages up to P batches are in flight.
"""
from __future__ import annotations

import dataclasses
import os
from collections import deque

import torch

from fusegen.engine.config import EngineConfig
from fusegen.engine.errors import EngineConfigError
from fusegen.engine.models import get_architecture
from fusegen.engine.parallel.group import DeviceGroup, check_shared_memory
from fusegen.engine.parallel.overlap import overlap_summary
from fusegen.engine.parallel.peer import group_holders
from fusegen.engine.parallel.plan import model_stages, rank_devices, rank_infos
from fusegen.engine.parallel.tesseract import tesseract_grid
from fusegen.engine.parallel.tesseract_batch import SequenceGroups
from fusegen.engine.parallel.worker import shared_logits
from fusegen.engine.model_runner import ModelRunner
from fusegen.engine.runner_api import LOGITS_CHUNK, Runner
from fusegen.engine.sampler import Sampler
from fusegen.engine.scheduler import ScheduledBatch
from fusegen.engine.step_inputs import step_inputs


def make_runner(config: EngineConfig) -> Runner:
    """The engine's runner: the whole model in this process, or a device group."""
    if config.options.tensor_parallel_size * config.options.pipeline_parallel_size == 1:
        return ModelRunner(config)
    return ParallelRunner(config)


class ParallelRunner(Runner):
    supports_prompt_logprobs = False  # the last stage returns the sampled rows' logits only
    supports_async_scheduling = False  # its stages keep their own batches in flight
    streamer = None  # each rank streams its own layers (its memory report says)
    graphs = None  # the ranks run every step eagerly

    def __init__(self, config: EngineConfig):
        options, cfg = config.options, config.model_config
        self.config = config
        self.tp, self.pp = options.tensor_parallel_size, options.pipeline_parallel_size
        self.max_in_flight = self.pp
        self.block_size = config.block_size
        self.num_blocks = config.placement.num_device_kv_blocks
        self.num_host_blocks = config.placement.num_host_kv_blocks
        arch = get_architecture(cfg.architecture)
        self.uses_request_lengths = arch.uses_request_lengths(cfg)
        world = self.tp * self.pp
        stages = list(config.stages) or model_stages(arch.layer_numel(cfg), cfg.num_layers,
                                                     cfg.vocab_size * cfg.hidden_size, self.pp)
        gpus = torch.cuda.device_count() if config.device.startswith("cuda") else 0
        # tensor_parallel_mode 2d / 2.5d: the ranks form a Tesseract grid, each step's
        # requests split into its sequence groups (checked by plan.check_grid)
        self.grid = None if options.tensor_parallel_mode == "1d" else \
            tesseract_grid(self.tp, options.tesseract_depth)
        self.sequence_groups = None if self.grid is None else SequenceGroups(self.grid)
        self.infos = rank_infos(self.tp, self.pp, stages,
                                rank_devices(config.device, world, gpus), _num_cores(),
                                0 if self.grid is None else self.grid.depth)
        self.infos = _with_peers(self.infos, config)
        self.sampler = Sampler("cpu", options.seed)
        rows = config.max_num_seqs
        logits_bytes = self.pp * rows * cfg.vocab_size * 4
        check_shared_memory(logits_bytes, f"{self.pp} stage(s) x max_num_seqs {rows} x "
                                          f"vocabulary {cfg.vocab_size} x 4 bytes")
        self.group = DeviceGroup(config, self.infos, logits_bytes, self.pp)
        self._in_flight: deque = deque()
        self._num_steps = 0

    @property
    def _replying_rank(self) -> int:
        return self.infos[-1].rank - self.tp + 1  # the last stage's first rank

    def submit(self, batch: ScheduledBatch) -> None:
        inputs = step_inputs(batch, self.block_size, self.uses_request_lengths)
        reqs = [batch.requests[i] for i in inputs.sample_reqs]
        greedy = Sampler.plain_greedy(reqs)
        index, self._num_steps = self._num_steps, self._num_steps + 1
        if self.grid is None:
            self.group.send_all(("step", index, inputs, greedy))
        else:
            groups = self.sequence_groups.assign(batch.requests)
            self.group.send_all(("step", index, inputs, greedy, groups))
        self._in_flight.append((index, batch, inputs, reqs))

    def overlap_steps(self) -> None:
        raise NotImplementedError("a device group keeps its own batches in flight (its "
                                  "pipeline stages): no asynchronous scheduling")

    def collect(self) -> list[int | None]:
        index, batch, inputs, reqs = self._in_flight.popleft()
        kind, _, payload = self.group.receive(self._replying_rank, ("tokens", "logits"),
                                              f"step {index}")
        tokens = payload if kind == "tokens" else self._sample(index, payload, reqs)
        out: list[int | None] = [None] * len(batch)
        for i, token in zip(inputs.sample_reqs, tokens):
            out[i] = token
        return out

    def _sample(self, index: int, num_rows: int, reqs: list) -> list[int]:
        """The step's tokens from its logits slot (the rank wrote them; this step's slot is
        not written again before the step `max_in_flight` later is submitted)."""
        vocab = self.config.model_config.vocab_size
        logits = shared_logits(self.group.logits, self.pp, vocab)[index % self.pp][:num_rows]
        tokens = []
        for start in range(0, num_rows, LOGITS_CHUNK):
            chunk = reqs[start:start + LOGITS_CHUNK]
            tokens += self.sampler.sample(logits[start:start + len(chunk)], chunk).tolist()
        return tokens

    def stage_trace(self) -> dict[int, list[tuple[int, float, float, float]]]:
        """Per rank, per step it ran: (step, started waiting for its input, compute
        start, compute end), in seconds of the machine's monotonic clock (the ranks
        share one machine's clock only on one machine)."""
        return {rank: trace for rank, trace, _, _ in self._stats()}

    def collective_bytes(self) -> dict[int, dict[str, int]]:
        """Per rank, the bytes its tensor-parallel collectives sent (ring counts) and
        the bytes it sent to the next stage."""
        return {rank: {"tensor_parallel": tp, "pipeline": pp}
                for rank, _, tp, pp in self._stats()}

    def tensor_parallel_overlap(self) -> dict:
        """The group's row-parallel sums timed (overlap.overlap_summary): compute,
        communication, the part of it hidden behind compute, per layer and in all."""
        return overlap_summary(self.group.ask("overlap"))

    def grid_layer_bytes(self) -> dict[int, list[dict[str, int]]]:
        """On a Tesseract grid: per rank, per layer, the bytes its grid collectives sent
        and received (tesseract.CommCounter), over every step so far."""
        self.group.send_all(("grid", -1))
        return {info.rank: self.group.receive(info.rank, "grid", "grid")[2]
                for info in self.infos}

    def stream_stats(self) -> dict[int, dict]:
        """Per rank: its streamed layers' loads, bytes and the seconds its compute waited
        for them, per tier they come from ("peer", "host", "disk"), and its steps run."""
        self.group.send_all(("streams", -1))
        out = {}
        for info in self.infos:
            _, rank, tiers, steps = self.group.receive(info.rank, "streams", "streams")
            out[rank] = {"steps": steps, "tiers": tiers}
        return out

    def _stats(self):
        self.group.send_all(("stats", -1))
        return [self.group.receive(info.rank, "stats", "stats")[1:] for info in self.infos]

    def memory_report(self) -> dict:
        """Rank 0's report (every rank of a stage holds the same), with every rank's."""
        report = dict(self.group.reports[0])
        report["ranks"] = self.group.reports
        report["group"] = {"tensor_parallel_size": self.tp, "pipeline_parallel_size": self.pp,
                           "tensor_parallel_mode": self.config.options.tensor_parallel_mode,
                           "grid": None if self.grid is None else str(self.grid),
                           "stages": [[i.layers.start, i.layers.stop] for i in self.infos
                                      if i.tp_rank == 0],
                           "devices": [i.device for i in self.infos]}
        return report

    def local_model(self) -> None:
        return None  # the ranks hold the weights

    def step_weight_bytes(self) -> None:
        return None  # the ranks hold the weights

    @property
    def failed(self) -> str | None:
        """The device_group_failed message once a rank failed (the group is gone)."""
        return self.group.failed

    def reset_streams(self) -> None:
        """A failed step leaves the group gone (DeviceGroupError); nothing to reset."""

    def close(self) -> None:
        self.group.close()


def _with_peers(infos: list, config: EngineConfig) -> list:
    """The ranks' infos with the group's peer holders (peer.assign_holders), checked
    before any rank starts."""
    plan = config.placement
    if "peer" not in plan.layer_tiers:
        return infos
    shared = max(info.device_ranks for info in infos)
    if shared > 1:
        raise EngineConfigError(
            f"peer_memory: device {config.device!r} puts {shared} ranks on one GPU, whose "
            "memory they already split; a peer tier lends one GPU's memory to another: "
            "leave peer_memory unset, or give each rank a GPU of its own")
    holders = group_holders(infos, plan.layer_tiers, plan.sizes.layer_bytes, plan.peer_spare)
    return [dataclasses.replace(info, peer_holders=holders) for info in infos]


def _num_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
