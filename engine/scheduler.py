"""Iteration-level scheduling (temporal fusion) over a paged KV cache. No tensors.

Every step the scheduler builds a fresh batch: running requests first, each getting
the tokens it has not computed yet (one for a decode, a chunk for a prefill), then
waiting requests while the token budget, `max_num_seqs` and free KV blocks allow.
Finished requests leave at once and free their blocks, so the batch stays full
whatever each request's length.

When a running request needs a block and none is free, the newest running request
is preempted: its blocks are swapped to the host pool when it has room (the request
keeps its computed tokens), otherwise freed, and the request recomputed later.
Swapped requests come back, oldest first, before any new request is admitted. The
oldest running request is therefore never preempted while another runs, and a
request alone always fits (`check_fits` refuses requests that could never fit the
whole pool), so every request makes progress.

With a pipeline (engine/parallel) several batches are in flight at once: a request in
a batch not yet collected is skipped when scheduling and is never chosen for
preemption (its blocks are being written); the oldest request not in flight plays the
oldest request's part above, and victims are recomputed rather than swapped.

With asynchronous scheduling (`overlap`) the engine schedules step N+1 before step N's
tokens are back, and a request may be in both: `advance` counts a submitted batch's
tokens as computed at once and ends each request it samples with a PLACEHOLDER token,
which N+1 feeds (the runner takes the id from step N's sampled ids), and `update`
puts the real token in its place. Only requests whose sampling needs nothing the host
decides per token go on while in flight (`Request.overlaps`), and never past
max_tokens / max_model_len; one that stops on a token (eos, stop ids, stop strings)
has already run one more, whose token is discarded. Requests in flight are still never
preempted: one that needs a block when none is free waits a step (deferred) while
newer requests in flight come back and become the victims, so the oldest request
still always runs.

With prefix caching, a request admitted from the waiting queue (new, or preempted to
be recomputed) first takes the cached blocks holding its leading full blocks, and its
computed tokens start past them; only the rest is scheduled.

With cooperative KV placement (engine/split_blocks.py) the same rules hold over both
pools: a request is admitted when its device blocks and its host blocks are free, and
nothing is swapped (the host pool holds running requests' blocks): victims are
recomputed.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from fusegen.engine.block_manager import BlockManager
from fusegen.engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)  # per request
    num_preempted: int = 0
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host) blocks
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device) blocks
    num_cached_tokens: int = 0  # prompt tokens admitted requests took from the prefix cache
    num_prompt_tokens: int = 0  # prompt tokens computed this step (prefill, recompute)
    # requests in flight left out for want of a free block (asynchronous scheduling)
    num_deferred: int = 0
    advanced: bool = False  # its tokens counted as computed when submitted (`advance`)
    num_generated: int = 0  # tokens its `update` appended (none discarded)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, request: Request, num_tokens: int) -> None:
        self.requests.append(request)
        self.num_scheduled_tokens.append(num_tokens)
        start = request.num_computed_tokens
        if start < request.num_prompt_tokens:
            self.num_prompt_tokens += min(request.num_prompt_tokens, start + num_tokens) - start

    def samples(self, index: int) -> bool:
        """Whether request `index` produces a token this step (its last chunk runs)."""
        req = self.requests[index]
        return req.num_computed_tokens + self.num_scheduled_tokens[index] == req.num_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, recompute_at: int = 0,
                 overlap: bool = False):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # A request growing from this many tokens to one more computes its whole
        # sequence again, in its blocks (LongRoPE's switch, models/phi3.py); 0: never.
        self.recompute_at = recompute_at
        self.overlap = overlap  # asynchronous scheduling (see the module's docstring)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def check_fits(self, request: Request) -> str | None:
        """Why the request can never run with this KV pool, or None."""
        longest = min(request.num_prompt_tokens + request.params.max_tokens, self.max_model_len)
        # The last sampled token is never fed back, so it needs no KV slot.
        need = self.block_manager.blocks_for(longest - 1)
        if need > self.block_manager.max_request_blocks:
            size = self.block_manager.block_size
            return (f"the request may grow to {longest} tokens, which needs {need} KV blocks "
                    f"of {size} tokens, "
                    f"but the KV cache holds {self.block_manager.max_request_blocks} blocks "
                    "a request can use; "
                    "lower max_tokens or give the KV cache more memory")
        return None

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def schedule(self, max_batch_seqs: int | None = None) -> ScheduledBatch:
        """The next batch; `max_batch_seqs` caps its requests (a pipeline splits the
        running requests over the batches it keeps in flight)."""
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        cap = max_batch_seqs or self.max_num_seqs
        i = 0
        while i < len(self.running) and budget > 0 and len(batch) < cap:
            req = self.running[i]
            if req.in_flight and not self._goes_on(req):
                i += 1
                continue
            n = min(req.num_uncomputed_tokens, budget)
            # most decode steps fit in the blocks a request holds: no room to make
            if self.block_manager.num_new_blocks(req, n) and not self._make_room(req, n, batch):
                break
            self.block_manager.allocate(req, n)
            batch.add(req, n)
            budget -= n
            i += 1
        if batch.num_preempted or batch.num_deferred:
            return batch  # no admissions while short of blocks
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs \
                and len(batch) < cap:
            req = self.swapped[0]
            n = min(req.num_uncomputed_tokens, budget)
            if not self.block_manager.can_swap_in(req, n):
                break
            self.swapped.popleft()
            batch.swap_in += self.block_manager.swap_in(req, n)
            self._run(req, n, batch)
            budget -= n
        if self.swapped:
            return batch  # swapped requests are older: they come back first
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs \
                and len(batch) < cap:
            req = self.waiting[0]
            hits = self.block_manager.computed_blocks(req)
            n = min(req.num_tokens - len(hits) * self.block_manager.block_size, budget)
            if not self.block_manager.can_allocate(req, n, hits):
                break
            self.waiting.popleft()
            self.block_manager.allocate(req, n, hits)
            self._count_cached(req, batch)
            self._run(req, n, batch)
            budget -= n
        return batch

    def _goes_on(self, req: Request) -> bool:
        """Whether a request in flight is scheduled again before its tokens are back:
        under asynchronous scheduling, in one batch only, when its sampling allows it and
        the token in flight is not its last."""
        return self.overlap and req.num_in_flight == 1 and req.overlaps \
            and not req.at_limit(self.max_model_len)

    @staticmethod
    def _count_cached(req: Request, batch: ScheduledBatch) -> None:
        """Just admitted: its computed tokens are those it found in the prefix cache."""
        cached = req.num_computed_tokens
        if req.num_preemptions == 0:  # the output reports the first admission's
            req.num_cached_tokens = cached
        batch.num_cached_tokens += min(cached, req.num_prompt_tokens)

    def _run(self, req: Request, num_tokens: int, batch: ScheduledBatch) -> None:
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        batch.add(req, num_tokens)

    def _make_room(self, req: Request, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Preempt from the newest end (skipping requests in flight) until `req` fits;
        False if `req` itself went."""
        while not self.block_manager.can_allocate(req, num_tokens):
            # With batches in flight the victims are recomputed, never swapped: this batch
            # may end up without requests, and a batch without requests does not run its
            # copies. (Asked only when short of blocks: a scan of every running request.)
            swap = not any(r.in_flight for r in self.running)
            at = next((i for i in range(len(self.running) - 1, -1, -1)
                       if not self.running[i].in_flight), None)  # `req` itself at the latest
            if self.overlap and not self._may_preempt(at, req):
                batch.num_deferred += 1
                return False
            victim = self.running.pop(at)
            self._preempt(victim, batch, swap)
            batch.num_preempted += 1
            if victim is req:
                return False
        return True

    def _may_preempt(self, at: int | None, req: Request) -> bool:
        """Asynchronous scheduling: whether running[at] (the newest not in flight) may
        make room for `req`: a newer request, or `req` itself when it is the newest. Else
        `req` waits a step, and the newer ones in flight are victims once back."""
        if at is None:
            return False
        mine = self.running.index(req)
        return at > mine or at == mine == len(self.running) - 1

    def _preempt(self, request: Request, batch: ScheduledBatch, swap: bool = True) -> None:
        request.num_preemptions += 1
        if swap and self.block_manager.can_swap_out(request):
            batch.swap_out += self.block_manager.swap_out(request)
            request.status = RequestStatus.SWAPPED
            self.swapped.appendleft(request)
            return
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def advance(self, batch: ScheduledBatch) -> None:
        """Asynchronous scheduling, once the runner has taken `batch`'s inputs: its tokens
        count as computed now, and each request it samples ends with a placeholder for
        the token, so the next step can be scheduled before this one's tokens are back.
        Requests that wait for their tokens (not `overlaps`) are left as they are: the
        step reads their generated tokens (penalties) and `update` advances them."""
        for i, (req, n) in enumerate(zip(batch.requests, batch.num_scheduled_tokens)):
            if not req.overlaps:
                continue
            samples = batch.samples(i)
            req.num_computed_tokens += n
            if samples:
                req.add_placeholder()
        batch.advanced = True

    def update(self, batch: ScheduledBatch, sampled: list[int | None]) -> list[Request]:
        """Advance the batch's counters by what ran (unless `advance` did); append sampled
        tokens (in their placeholders' place); return every request that finished this
        step, stop strings included (their blocks are already free)."""
        finished = []
        for req, n, token in zip(batch.requests, batch.num_scheduled_tokens, sampled):
            req.num_in_flight -= 1
            if req.is_finished:  # aborted, or stopped by the token before: discarded
                continue
            advanced = batch.advanced and req.overlaps
            if not advanced:
                req.num_computed_tokens += n
            if token is None:
                continue
            batch.num_generated += 1
            reason = req.fill_placeholder(token, self.max_model_len) if advanced \
                else req.append_token(token, self.max_model_len)
            if reason is not None:
                self._finish(req, reason)
                finished.append(req)
            elif self.recompute_at and req.num_computed_tokens == self.recompute_at \
                    and req.num_tokens == self.recompute_at + 1:
                req.num_computed_tokens = 0
        if finished:
            self.running = [r for r in self.running if not r.is_finished]
        return finished

    def finish(self, requests: list[Request], reason: str) -> None:
        """End requests from outside a step (an abort)."""
        for req in requests:
            self._finish(req, reason)
        gone = set(map(id, requests))
        self.running = [r for r in self.running if id(r) not in gone]
        self.waiting = deque(r for r in self.waiting if id(r) not in gone)
        self.swapped = deque(r for r in self.swapped if id(r) not in gone)

    def _finish(self, request: Request, reason: str) -> None:
        request.drop_placeholders()  # an abort while its tokens were in flight
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.block_manager.free(request)
        self.block_manager.free_host(request)
