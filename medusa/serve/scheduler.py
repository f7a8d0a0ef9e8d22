"""Continuous batching: one thread owns the model and runs every request's decode steps.

Every request is a row of one :class:`medusa.decode.loop.RunningBatch`, greedy or sampling alike: a request joins once
its prompt is prefilled on its own, ``prefill_chunk`` tokens per round (chunked prefill: a long prompt joins over
several rounds, the running rows stepping between them), shares every verify forward with the rows running, each
row accepted with its own rule, settings and random generator (:mod:`medusa.decode.acceptance`), and leaves when it
stops, is
cancelled (the client went away, a stop string matched, its deadline passed) or fails. Every running request advances
once per round of the loop, and a round runs one batched step: no request waits more than a bounded number of steps.

Each batched step is speculative or plain (the root alone) as :class:`StepChoice` decides for the batch size at hand;
speculative while a row samples, so that a seeded request draws as ``generate`` with that seed does.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from medusa.decode.logits_process import Decoding
from medusa.decode.loop import GenerationStats, Joining, RunningBatch, Step
from medusa.decode.prefix import PrefixStore
from medusa.drafters.composite import NoDrafter
from medusa.engines.threads import release_openmp_threads

logger = logging.getLogger(__name__)

SPECULATION = ("auto", "on", "off")
"""``auto``: each batched step speculative or plain, whichever measured faster at that batch size; ``on``: always
speculative; ``off``: plain decoding throughout."""


def release_free_memory() -> bool:
    """Hand the C allocator's free pages back to the system: glibc's ``malloc_trim(0)``.

    A server's resident size otherwise keeps the high-water mark of every batch it has run: tensors freed after a
    step stay in the allocator's arenas (one per thread that allocated), so resident memory after a busy spell
    reads as growth though nothing is live. Returns whether the call was made (False where the C library has no
    ``malloc_trim``: musl, macOS).
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


class QueueFull(Exception):
    """The scheduler's waiting queue is full (the server answers 429)."""


@dataclass
class Job:
    """One request on its way through the scheduler.

    ``deliver`` is called from the scheduler thread with ``("tokens", list[int])``, then ``("done", finish_reason)``
    (``"stop"``: a stop token; ``"length"``: the budget) or ``("error", message, HTTP status)``; it must not
    block.
    """

    ids: torch.Tensor
    """``(T,)`` long prompt ids, on the model's device."""
    max_new_tokens: int
    decoding: Decoding
    deliver: Callable[[tuple], None]
    stats: GenerationStats = field(default_factory=GenerationStats)
    cancelled: bool = False
    """Set from any thread: the scheduler drops the job before its next step."""


class StepChoice:
    """Speculative or plain batched decoding, per step, for the current batch size: whichever gave more tokens per
    second over the last ``window`` steps measured in that mode at that size (their tokens over their seconds, the
    slowest step left out: a step slowed once, by a new shape's first kernel or by the rest of the machine, does not
    decide), so that speculation never costs throughput for long. Each mode is tried ``warm`` times at a size first
    (unless a neighbouring size already says, :meth:`guess`; the other mode is then measured every
    ``explore_every`` steps); then the losing mode again every ``explore_every`` steps while it is close (within
    ``close`` of the winner's rate), every ``4 * explore_every`` when it is not, as acceptance and costs drift.

    A batch size neither measured nor guessed from its neighbours starts from the machine profile's costs
    (:meth:`prior`), once any speculative step has shown how many tokens a row gains and how large its tree is.

    Args:
        mode: one of :data:`SPECULATION`.
        forward_s: seconds of one forward over ``m`` new tokens (``m`` summed over the rows: a batched forward of
            ``B`` rows of ``n`` tokens costs about what one row of ``B * n`` tokens costs once the products are
            compute-bound), from this machine's profile (:func:`profile_forward_s`); ``None``: no prior, each batch
            size measured as it comes.
    """

    def __init__(self, mode: str = "auto", warm: int = 3, explore_every: int = 16, window: int = 16,
                 close: float = 0.85, forward_s: Callable[[int], float] | None = None):
        if mode not in SPECULATION:
            raise ValueError(f"speculation must be one of {SPECULATION}, got {mode!r}")
        self.mode, self.warm, self.explore_every, self.close = mode, warm, explore_every, close
        self.window, self.forward_s = window, forward_s
        self.steps: dict[tuple[int, bool], deque[tuple[int, float]]] = {}
        """``(batch size, plain)`` -> the last ``window`` steps' ``(tokens, seconds)``."""
        self.count: dict[tuple[int, bool], int] = {}
        self.spec_rows = self.spec_tokens = self.spec_nodes = 0
        """Rows, tokens emitted and tree nodes verified, summed over every speculative step recorded."""

    def rate(self, batch: int, plain: bool) -> float:
        """Tokens per second of the last steps measured in that mode at ``batch`` rows, the slowest left out (a
        speculative step's tokens vary from step to step: the rate is their sum over the time, not a typical
        step's)."""
        steps = sorted(self.steps[(batch, plain)], key=lambda s: s[1])
        kept = steps[:-1] if len(steps) > 2 else steps
        return sum(t for t, _ in kept) / max(sum(s for _, s in kept), 1e-9)

    def plain(self, batch: int) -> bool:
        """Whether the next step at ``batch`` rows should be plain."""
        if self.mode != "auto":
            return self.mode == "off"
        spec, plain = self.count.get((batch, False), 0), self.count.get((batch, True), 0)
        if spec >= self.warm and plain >= self.warm:
            spec_rate, plain_rate = self.rate(batch, False), self.rate(batch, True)
            close = min(spec_rate, plain_rate) >= self.close * max(spec_rate, plain_rate)
            every = self.explore_every * (1 if close else 4)
            return (plain_rate > spec_rate) != ((spec + plain) % every == 0)
        guess = self.guess(batch)
        if guess is None:
            guess = self.prior(batch)
        if guess is None:  # nothing known: measure both, speculative first
            return spec >= self.warm
        # The other mode measured now and then, never first: the first step at a new size follows the guess.
        return guess != ((spec + plain) % self.explore_every == self.explore_every - 1)

    def guess(self, batch: int) -> bool | None:
        """Plain at ``batch`` rows (``True``) when plain won at a smaller batch size, speculative (``False``) when
        speculation won at a larger one, ``None`` when neither is known: speculation pays less as the batch grows
        (its forwards turn compute-bound, docs/batching.md), so an unmeasured size need not pay to learn it."""
        measured = {b for (b, _) in self.count if all(self.count.get((b, p), 0) >= self.warm for p in (False, True))}
        wins = {b: self.rate(b, True) > self.rate(b, False) for b in measured}
        if any(won for b, won in wins.items() if b < batch):
            return True
        if any(not won for b, won in wins.items() if b > batch):
            return False
        return None

    def prior(self, batch: int) -> bool | None:
        """Plain at ``batch`` rows (``True``) when the profile's costs say a plain step emits more tokens per second
        than a speculative one: ``batch * tau / forward_s(batch * n)`` against ``batch / forward_s(batch)``, with
        ``tau`` (tokens per row per step) and ``n`` (tree nodes per row) averaged over the speculative steps seen so
        far at any size (acceptance depends on the text, not on the batch); ``None`` without ``forward_s`` or
        before any speculative step."""
        if self.forward_s is None or not self.spec_rows:
            return None
        tau, nodes = self.spec_tokens / self.spec_rows, self.spec_nodes / self.spec_rows
        speculative = batch * tau / self.forward_s(max(1, round(batch * nodes)))
        return batch / self.forward_s(batch) > speculative

    def record(self, batch: int, plain: bool, tokens: int, seconds: float, nodes: int | None = None) -> None:
        """One step's ``tokens`` emitted over all rows in ``seconds``; ``nodes``: the tree nodes it verified over
        all rows (root included), for :meth:`prior` (a speculative step without them is not counted there)."""
        key = (batch, plain)
        self.steps.setdefault(key, deque(maxlen=self.window)).append((tokens, seconds))
        self.count[key] = self.count.get(key, 0) + 1
        if not plain and nodes is not None:
            self.spec_rows, self.spec_tokens, self.spec_nodes = (self.spec_rows + batch, self.spec_tokens + tokens,
                                                                 self.spec_nodes + nodes)


def profile_forward_s(model) -> Callable[[int], float] | None:
    """``m -> seconds`` of one forward over ``m`` new tokens through ``model``'s engine, read from this machine's
    stored profile (:func:`medusa.profile.stored_profile`; nothing is measured), or ``None`` when none is stored or
    it lacks the engine: :class:`StepChoice`'s prior."""
    from medusa.profile import stored_profile

    profile, _ = stored_profile(model.base)
    name = model.engine.profile_name
    if profile is None or name not in profile.usable():
        return None
    return lambda m: profile.forward_s(name, m)


class Scheduler:
    """The thread that owns the model (see module docstring).

    Args:
        model: a :class:`medusa.model.MedusaModel`.
        max_running: the most requests decoding at once (rows of the batch).
        max_waiting: the most requests waiting to start; :meth:`submit` raises :class:`QueueFull` beyond.
        speculation: one of :data:`SPECULATION`.
        idle_release_s: after this many seconds with nothing to do (once per idle spell), the free memory of the
            C allocator goes back to the system (:func:`release_free_memory`); 0: never.
        prefix_cache_bytes: the most bytes of prefilled prompts' keys and values kept for later prompts that start
            alike (:class:`medusa.decode.prefix.PrefixStore`; exact, through the engines that give snapshots); 0:
            none kept.
    """

    def __init__(self, model, max_running: int = 16, max_waiting: int = 64, speculation: str = "auto",
                 forward_s: Callable[[int], float] | None = None, prefill_chunk: int = 256,
                 idle_release_s: float = 2.0, prefix_cache_bytes: int = 0):
        if (max_running < 1 or max_waiting < 0 or prefill_chunk < 1 or not idle_release_s >= 0
                or not 0 <= prefix_cache_bytes < float("inf")):
            raise ValueError(f"max_running and prefill_chunk must be >= 1 and max_waiting, idle_release_s and "
                             f"prefix_cache_bytes >= 0, got {max_running}, {prefill_chunk}, {max_waiting}, "
                             f"{idle_release_s}, {prefix_cache_bytes}")
        self.idle_release_s = idle_release_s
        self.memory_releases = 0
        """Idle spells after which the free memory was handed back (:func:`release_free_memory`)."""
        self.last_release_ms: float | None = None
        """How long the last hand-back took (a request arriving meanwhile waits for it)."""
        self.model, self.max_running, self.max_waiting = model, max_running, max_waiting
        self.prefill_chunk = prefill_chunk
        self.joining: deque[tuple[Job, Joining]] = deque()
        """Admitted jobs whose prompts are being prefilled, oldest first (they hold running slots)."""
        self.choice = StepChoice(speculation, forward_s=forward_s)
        drafter = NoDrafter() if speculation == "off" else model.drafter
        # Every node scored in one product where the engine declares it cheaper (as generate does), else the path.
        self.batch = RunningBatch(model.base, drafter, model.engine)
        if prefix_cache_bytes:
            self.batch.prefix_store = PrefixStore(prefix_cache_bytes)
        self.jobs: dict[int, Job] = {}  # the batch's rows by key
        self.waiting: deque[Job] = deque()
        self.stop_ids = model.stop_token_ids()
        self._lock = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.plain_steps = 0
        """Batched steps run plain (the root alone)."""
        self.sampling_row_steps = 0
        """Rows that sampled, summed over the batched steps (they share the forwards with the greedy rows)."""

    # -- from other threads -------------------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue ``job``; it starts at the scheduler's next round with a free slot.

        Raises:
            QueueFull: ``max_waiting`` jobs are already waiting.
            RuntimeError: the scheduler is stopping.
        """
        with self._lock:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            if len(self.waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self.waiting)} requests are already waiting (the server's limit): retry later")
            self.waiting.append(job)
            self._lock.notify()

    def start(self) -> None:
        """Start the scheduler thread. The calling thread's OpenMP workers are freed first
        (:func:`medusa.engines.threads.release_openmp_threads`): left in place, the scheduler thread's own pool
        would make libgomp's waiting workers sleep at every barrier (0.68-0.74x the speed on 2 cores). It is a
        speed-up only: if it fails, a warning says so and the scheduler starts anyway."""
        try:
            release_openmp_threads()
        except Exception as e:  # a speed-up is never a reason not to serve
            logger.warning("could not free this thread's OpenMP workers (decoding may run slower): %s: %s",
                           type(e).__name__, e)
        self._thread = threading.Thread(target=self._run, name="medusa-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the current step; jobs still waiting or running get an error."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def load(self) -> int:
        """Requests running and waiting (from any thread)."""
        with self._lock:
            return len(self.jobs) + len(self.joining) + len(self.waiting)

    def snapshot(self) -> dict:
        """Counters for ``/health``: requests running and waiting, verify forwards and the rows they held."""
        with self._lock:
            waiting = len(self.waiting)
        batch = self.batch
        return {"running": len(self.jobs), "prefilling": len(self.joining), "waiting": waiting,
                "batched_forwards": batch.forwards,
                "max_rows_per_forward": batch.max_rows, "row_forwards": batch.row_forwards,
                "plain_steps": self.plain_steps, "sampling_row_steps": self.sampling_row_steps,
                "memory_releases": self.memory_releases, "last_memory_release_ms": self.last_release_ms,
                **self._prefix_counters()}

    def _prefix_counters(self) -> dict:
        store = self.batch.prefix_store
        if store is None:
            return {"prefix_cache_bytes": 0, "prefix_hits": 0, "prefix_reused_tokens": 0}
        return {"prefix_cache_bytes": store.nbytes, "prefix_hits": store.hits,
                "prefix_reused_tokens": store.reused_tokens}

    # -- the scheduler thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        idle_since: float | None = None  # None: worked since the last release
        while True:
            with self._lock:
                if self._stopping:
                    break
                if not self.waiting and not self.jobs and not self.joining:
                    self._lock.wait(0.05)
                    idle_since = self._release_when_idle(idle_since)
                    continue
            idle_since = None
            try:
                self._round()
            except Exception:  # a fault of the scheduler itself must not leave requests waiting forever
                logger.exception("scheduler round failed")
                self._fail_running("internal error in the scheduler")
        self._fail_all("the server is shutting down")

    def _release_when_idle(self, idle_since: float | None) -> float | None:
        """Start or continue an idle spell; at ``idle_release_s`` into it, release the free memory once. Returns
        the spell's start, or ``inf`` once released (nothing more until the next work)."""
        now = time.monotonic()
        if idle_since is None:
            return now
        if self.idle_release_s and now - idle_since >= self.idle_release_s:
            if release_free_memory():
                self.memory_releases += 1
                self.last_release_ms = round(1000 * (time.monotonic() - now), 2)
            return float("inf")
        return idle_since

    def _round(self) -> None:
        """Admit, prefill up to ``prefill_chunk`` prompt tokens, drop the cancelled, then one batched step for
        every running job."""
        self._admit()
        self._prefill()
        self._drop_cancelled()
        if self.jobs:
            self._batched_step()

    def _admit(self) -> None:
        """Start waiting jobs while slots are free (their prompts are prefilled by :meth:`_prefill`, the oldest
        first, and each joins the batch's step after its last chunk)."""
        while len(self.jobs) + len(self.joining) < self.max_running:
            with self._lock:
                if not self.waiting:
                    return
                job = self.waiting.popleft()
            if job.cancelled:
                continue
            try:
                joining = self.batch.begin(id(job), job.ids, job.max_new_tokens, self.stop_ids, job.stats,
                                           job.decoding)
            except Exception as e:  # one bad request must not stop the others
                logger.exception("prefill failed")
                job.deliver(("error", f"decoding failed: {e}", 500))
                continue
            with self._lock:
                self.joining.append((job, joining))

    def _prefill(self) -> None:
        """Prefill up to ``prefill_chunk`` prompt tokens of the joining jobs, the oldest first, in whole chunks of
        each prompt's own: ``prefill_chunk`` tokens, then the rest (a prompt within the budget joins in one forward,
        as alone). Where a prompt is cut so depends on the prompt alone, never on the requests beside it (a chunk
        boundary changes the logits' rounding); a chunk that does not fit what is left of the round's budget waits
        for the next round. A job whose last chunk ran joins the batch."""
        budget = self.prefill_chunk
        while budget > 0 and self.joining:
            job, joining = self.joining[0]
            if job.cancelled:
                self._pop_joining()
                job.deliver(("error", "the request was cancelled", 499))
                continue
            tokens = min(self.prefill_chunk, joining.left)
            if tokens > budget:
                break
            budget -= tokens
            try:
                step = self.batch.prefill(joining, tokens)
            except Exception as e:  # one bad request must not stop the others
                logger.exception("prefill failed")
                self._pop_joining()
                job.deliver(("error", f"decoding failed: {e}", 500))
                continue
            if step is None:
                continue  # more chunks at the next rounds
            self._pop_joining()
            self._deliver(job, step)
            if not job.stats.stopped_by:
                self.jobs[joining.key] = job

    def _pop_joining(self) -> None:
        with self._lock:
            self.joining.popleft()

    def _drop_cancelled(self) -> None:
        """Drop cancelled jobs; each gets an error event, so that whoever still waits on it stops waiting."""
        with self._lock:
            dropped_joins = [job for job, _ in self.joining if job.cancelled]
            if dropped_joins:
                self.joining = deque(pair for pair in self.joining if not pair[0].cancelled)
        for job in dropped_joins:
            job.deliver(("error", "the request was cancelled", 499))
        gone = [key for key, job in self.jobs.items() if job.cancelled]
        if gone:
            self.batch.leave(gone)
        dropped = [self.jobs.pop(key) for key in gone]
        for job in dropped:
            job.deliver(("error", "the request was cancelled", 499))

    def _batched_step(self) -> None:
        size = len(self.jobs)
        # Speculative whenever a row samples: a plain step would draw that row's random numbers in another order
        # than generate() with the same seed (greedy rows get the same tokens either way).
        plain = self.choice.plain(size) and not any(job.decoding.do_sample for job in self.jobs.values())
        start = time.perf_counter()
        try:
            out = self.batch.step(plain)
        except Exception as e:
            logger.exception("batched step failed")
            self._fail_running(f"decoding failed: {e}")
            return
        nodes = sum(self.jobs[key].stats.tree_nodes[-1] for key, _ in out if self.jobs[key].stats.tree_nodes)
        self.choice.record(size, plain, sum(len(s.tokens) for _, s in out), time.perf_counter() - start, nodes)
        self.plain_steps += plain
        self.sampling_row_steps += sum(self.jobs[key].decoding.do_sample for key, _ in out)
        for key, step in out:
            job = self.jobs[key]
            self._deliver(job, step)
            if job.stats.stopped_by:
                del self.jobs[key]

    @staticmethod
    def _deliver(job: Job, step: Step) -> None:
        if step.tokens:
            job.deliver(("tokens", list(step.tokens)))
        if job.stats.stopped_by:
            job.deliver(("done", "stop" if job.stats.stopped_by == "stop_token" else "length"))

    def _fail_running(self, message: str) -> None:
        """End the batch's rows with a 500 error."""
        self.batch.leave(list(self.jobs))
        failed = list(self.jobs.values())
        self.jobs.clear()
        for job in failed:
            job.deliver(("error", message, 500))

    def _fail_all(self, message: str) -> None:
        with self._lock:
            left = [*self.waiting, *(job for job, _ in self.joining), *self.jobs.values()]
            self.waiting.clear()
            self.joining.clear()
        for job in left:
            job.deliver(("error", message, 503))
        self.jobs.clear()
