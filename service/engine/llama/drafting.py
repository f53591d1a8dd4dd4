"""Drafting behind one interface: a step's guesses for each generating sequence, from its own tokens and its
scope's earlier answers (``service.engine.speculation``), the plan's draft model (``service.engine.draft``) or the
file's MTP head (``service.engine.mtp``). The guesses go into the step's batch and are verified there
(``Sequences.verify``); which source a sequence drafts from is fixed when it starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence as Seq

from ..base import GenerationParams
from ..draft import DraftJob, DraftModelRunner
from ..mtp import MtpRunner
from ..replay import TOLERANCE, Replays
from ..speculation import DRAFT_MIN, POOL_ANSWERS, DraftPolicy, NgramDrafter, NgramPolicy, NgramPool, StepCosts

if TYPE_CHECKING:
    from .state import Sequence


class Drafting:
    """One load's drafting: its source, its pool of answers, the step's draft-model jobs."""

    def __init__(self, runner: DraftModelRunner | MtpRunner | None, *, on: bool, draft_max: int,
                 replay_tolerance: float = TOLERANCE) -> None:
        self.runner = runner
        self.on = on and draft_max >= DRAFT_MIN
        """Sequences draft (speculation on, a model without recurrent state)."""
        self._draft_max = draft_max
        self.rows = 0
        """Logits rows beyond one per sequence held for drafts (the plan's ``draft_rows``, reserved at load)."""
        self.answers = NgramPool(POOL_ANSWERS)
        """Finished answers per cache scope, for the n-gram drafts of later requests."""
        self.replays = Replays(tolerance=replay_tolerance)
        """Greedy answers by their prompt, per cache scope: a request asked again takes them (``Sequences``), and
        drafts from them whole (``reserve``), whether or not speculation is on."""
        self.costs = StepCosts()
        """The load's decode time by a step's rows (``BatchStep.run`` records them), which sizes n-gram drafts."""
        self._jobs: list[tuple["Sequence", DraftJob]] = []

    @property
    def mtp(self) -> MtpRunner | None:
        return self.runner if isinstance(self.runner, MtpRunner) else None

    def assign(self, reqs: list["Sequence"], params: GenerationParams, *, images: bool) -> None:
        """Each choice's drafter and length policy (none with ``speculative`` off); the draft model sees no image:
        a prompt with one drafts from its own tokens."""
        if not (self.on and params.speculative):
            return
        # Only a greedy request without a grammar drafts from the pool and sizes its drafts by the load's measured
        # step costs. A draft's rows are computed in one batch, whose rounding can move a sampled token or a
        # grammar's pick between near-equal logits, and a request asked twice must answer the same: the second
        # would draft from the first's answer where the first drafted nothing (seeded and JSON stream-against-whole
        # checks failed so), and the measured costs move with every step timed on shared cores, so the same draft
        # was cut at other lengths each time (a seeded tool call asked 8 times on a busy machine: 2 answers). The
        # others size their drafts by ``STEP_COST_PRIOR`` and what their own drafts kept: the same shapes each time.
        # A seeded one asked again drafts its own earlier answer whole (``reserve``: the replay), as a greedy one.
        exact = bool(reqs) and reqs[0].greedy
        pool = self.answers if exact else None
        for r in reqs:
            r.drafter = (self.runner if not images else None) or NgramDrafter(pool=pool, scope=params.cache_scope)
            r.policy = (NgramPolicy(draft_max=self._draft_max, costs=self.costs if exact else StepCosts())
                        if isinstance(r.drafter, NgramDrafter) else DraftPolicy(draft_max=self._draft_max))

    def reserve(self, r: "Sequence", spare: int, room: int, base: int = 1) -> int:
        """Rows of this step for ``r``'s guesses (at most ``spare`` and ``room``; ``base``: the step's generating
        rows without them): the n-gram drafter's now, a draft model's held for ``run`` (all of the step's at
        once)."""
        assert r.policy is not None and r.slot is not None and r.next_token is not None
        k = min(spare, room, r.max_new_tokens - r.n_out - 1)
        if r.replay is not None and r.n_out < len(r.replay):
            # The earlier answer to this prompt, as long as allowed: it is taken to within the rounding.
            r.draft = r.replay[r.n_out:r.n_out + min(k, self._draft_max)]
            return len(r.draft)
        if isinstance(r.drafter, NgramDrafter):
            k = min(k, r.policy.draft_max)
            if k < DRAFT_MIN:
                return 0
            draft = r.drafter.draft(r.slot.tokens, r.next_token, k)
            if draft:
                assert isinstance(r.policy, NgramPolicy)
                draft = draft[:r.policy.budget(r.n_out, r.drafter.matched, pooled=r.drafter.pooled, base=base)]
            r.draft = draft
            return len(r.draft)
        if (k := min(k, r.policy.budget(r.n_out))) < DRAFT_MIN:
            return 0
        self._jobs.append((r, DraftJob(r.slot.id, [*r.slot.tokens, r.next_token], k, [])))
        return k

    def run(self) -> int:
        """The draft model's guesses for the sequences that reserved rows; the rows they did not use."""
        jobs, self._jobs = self._jobs, []
        if not jobs:
            return 0
        assert self.runner is not None
        self.runner.draft([j for _, j in jobs])
        freed = 0
        for r, j in jobs:
            r.draft = j.draft
            if not j.draft:
                r.policy.declined(r.n_out)  # type: ignore[union-attr]
            freed += j.k - len(j.draft)
            r.batch_take -= j.k - len(j.draft)
        return freed

    def observe(self, runs: Seq[tuple[int, int, Seq[int], int, Seq[int], object]], n_rows: int) -> None:
        """The MTP head follows every sequence the step fed (``MtpRunner.observe``)."""
        mtp = self.mtp
        if mtp is not None:
            mtp.observe(runs, n_rows)

    def answer_ended(self, r: "Sequence", tokens: list[int], *, whole: bool = True) -> None:
        """An answer that ended: a greedy or seeded one by its prompt (``Sequence.replay_key``), for the same
        request again, even cut short (a stop string seen by the client's side ends it so: what it sent is still
        the answer's start); a whole one (not cancelled) into its scope's pool, for later drafts."""
        if r.replay_key is not None and not r.images:
            self.replays.add(r.params.cache_scope, r.tokens, r.answer, r.replay_key)
        if whole and isinstance(r.drafter, NgramDrafter):
            self.answers.add(r.params.cache_scope, tokens, len(r.tokens))

    def forget(self) -> None:
        self.answers.clear()
        self.replays.clear()

    def close(self) -> Any:
        """The draft model or MTP head to close with the load (it holds llama.cpp objects)."""
        runner, self.runner = self.runner, None
        return runner
