"""The KV pool beside the weights: the largest pool (in whole blocks) whose plan offloads no
more weight bytes than the least pool the job asks for (`largest_pool`), the pool a given
max_batch gets when even offloading cannot make room for its sequences (`capped`: the batch is
a cap, as vLLM takes max_num_seqs), and the pool the cost model chooses for a batch
(`choose_pool`). Used by `batch_size` (a job's pool and batch) and `throughput` (a given batch
that does not fit). Pure, no Ray.

`choose_pool` prices a pool as the trade it is: the weight bytes it pushes to host memory (a
longer time per token, the plan's `cycle_s`) against the sequences it lets run at once.
- With the lengths traffic brought (`Lengths`), the pool with the most predicted tokens/s:
  the sequences it holds at their footprint (each at its end, its largest), up to max_batch,
  over the time per token. Ties go to the larger pool (room for the lengths to vary).
- Without them, the guess (sequences at the expected length, and what the weights leave
  beside them for free) is insured: the largest pool, up to every sequence at max_seq_len,
  whose time per token is within POOL_SHARE of the guess's. A pool too small for the traffic
  runs fewer sequences at once and moves each offloaded byte more often per token (issue 59:
  1.62x the ideal bytes, for a pool 1.5 MiB of weights short).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from coordinator.planning import planner
from coordinator.planning.checkpoint import LayerSpec
from coordinator.planning.formats import format_seconds
from coordinator.planning.options import PlanOptions
from coordinator.planning.planner import Plan
from coordinator.planning.snapshot import ClusterSnapshot
from offload.errors import PlanError
from worker.names import DEFAULT_BLOCK_SIZE, blocks_for


def offloaded_bytes(the_plan: Plan) -> int:
    return sum(s.offloaded_bytes for s in the_plan.stages)


def largest_pool(
    layers: Sequence[LayerSpec],
    cluster: ClusterSnapshot,
    options: PlanOptions,
    cap_tokens: int,
    floor_tokens: int = 0,
) -> tuple[int, Plan]:
    """(pool tokens, its plan): the largest pool in whole blocks, from `floor_tokens` (at
    least one sequence of max_seq_len) up to `cap_tokens`, whose plan offloads no more weight
    bytes than the floor's. PlanError when not even the floor fits."""
    if options.max_seq_len < 1:
        raise PlanError(
            "sizing the KV pool needs max_seq_len (tokens per sequence): set --max-seq-len"
        )
    low = max(blocks_for(options.max_seq_len), blocks_for(floor_tokens))
    high = max(low, blocks_for(cap_tokens))

    def planned(blocks: int) -> Plan:
        tokens = blocks * DEFAULT_BLOCK_SIZE
        return planner.plan(layers, cluster, dataclasses.replace(options, kv_tokens=tokens))

    best = planned(low)
    floor = offloaded_bytes(best)
    while low < high:  # the answer is in [low, high]; fewer bytes free as the pool grows
        mid = (low + high + 1) // 2
        try:
            candidate = planned(mid)
        except PlanError:
            high = mid - 1
            continue
        if offloaded_bytes(candidate) <= floor:
            low, best = mid, candidate
        else:
            high = mid - 1
    return low * DEFAULT_BLOCK_SIZE, best


def capped(
    layers: Sequence[LayerSpec], cluster: ClusterSnapshot, options: PlanOptions, max_batch: int
) -> tuple[int, int]:
    """(max_batch, pool tokens) for a given max_batch taken as a cap, as vLLM takes
    max_num_seqs, when the pool for max_batch sequences at the expected length cannot fit even
    with weights offloaded: the largest pool beside the weights (`largest_pool`, from one
    sequence of max_seq_len up to max_batch of them) with max_batch slots, the queue and
    preemption doing the rest. Fewer slots only where their per-sequence state (recurrent
    layers) does not fit beside one max_seq_len sequence. PlanError when not even one fits."""
    batch = max_batch
    while True:
        sized = dataclasses.replace(
            options, max_batch=batch, micro_batches=max(options.micro_batches, 1), kv_tokens=0
        )
        cap = batch * blocks_for(options.max_seq_len) * DEFAULT_BLOCK_SIZE
        try:
            return batch, largest_pool(layers, cluster, sized, cap)[0]
        except PlanError:
            if batch == 1:
                raise
            batch = max(1, batch // 2)


# Without known lengths, how much longer a time per token the plan accepts to hold every
# sequence to max_seq_len (or as close as it gets) rather than the expected length only.
POOL_SHARE = 0.05
# A time per token this close to another's is the same step (float noise of the cost model).
_SAME_STEP = 1e-9


@dataclass(frozen=True, slots=True)
class Lengths:
    """Sequences as traffic brought them: (prompt tokens, generated tokens) of each."""

    sequences: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if not self.sequences:
            raise ValueError("Lengths needs at least one sequence")
        for prompt, generated in self.sequences:
            if prompt < 1 or generated < 0:
                raise ValueError(
                    f"a sequence of {prompt} prompt and {generated} generated tokens: the "
                    "prompt must be >= 1 token and the output >= 0"
                )

    def footprint_tokens(self, max_seq_len: int) -> float:
        """KV positions a sequence holds at its end (prompt and output, cut at max_seq_len, in
        whole blocks), the mean over the sequences. Its end, not its mean over its life:
        requests that arrive together grow together and need their largest at once (then a
        pool sized for their mean preempts them: bench/kv_plan.py's long phase measured 1.47x
        the ideal bytes per token with one), while requests spread in time hold less, and the
        larger pool this prices costs only the time per token it was priced at."""
        total = 0
        for prompt, generated in self.sequences:
            total += blocks_for(min(prompt + generated, max_seq_len)) * DEFAULT_BLOCK_SIZE
        return total / len(self.sequences)

    def describe(self) -> str:
        prompts = sorted(p for p, _ in self.sequences)
        outputs = sorted(g for _, g in self.sequences)
        return (
            f"{len(self.sequences)} sequences, median prompt {prompts[len(prompts) // 2]} "
            f"+ {outputs[len(outputs) // 2]} generated tokens"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class PoolPrice:
    """One pool the choice weighed: its time per token, the sequences it runs at once (under
    the lengths; without them, of max_seq_len) and their predicted tokens/s."""

    tokens: int
    cycle_s: float
    held: float
    tokens_per_s: float
    offloaded_bytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class PoolChoice:
    plan: Plan  # the chosen pool's (options.kv_tokens)
    weighed: tuple[PoolPrice, ...]  # in pool order, the chosen one among them
    reason: str

    @property
    def tokens(self) -> int:
        return self.plan.options.kv_tokens

    def text(self) -> str:
        """The alternatives weighed and why this one, as `offloadctl plan` prints them."""
        cells = [
            f"{p.tokens}: {format_seconds(p.cycle_s)}/token, {p.held:.1f} at once, "
            f"{p.tokens_per_s:.1f} tokens/s" + (" (chosen)" if p.tokens == self.tokens else "")
            for p in self.weighed
        ]
        return f"KV pool tokens weighed: {'; '.join(cells)}. {self.reason}"


def price(the_plan: Plan, lengths: Lengths | None, max_batch: int, max_seq_len: int) -> PoolPrice:
    """`the_plan`'s pool priced (`PoolPrice`): sequences at once under `lengths` (at
    max_seq_len without), up to max_batch, over its time per token."""
    tokens = the_plan.options.kv_tokens or the_plan.options.pool_tokens
    if lengths is None:
        held = float(the_plan.options.sequences_held(max_seq_len, tokens))
    else:
        held = tokens / lengths.footprint_tokens(max_seq_len)
    held = min(float(max_batch), held)
    return PoolPrice(
        tokens=tokens,
        cycle_s=the_plan.cycle_s,
        held=held,
        tokens_per_s=held / the_plan.cycle_s if the_plan.cycle_s > 0 else 0.0,
        offloaded_bytes=offloaded_bytes(the_plan),
    )


def choose_pool(
    layers: Sequence[LayerSpec],
    cluster: ClusterSnapshot,
    options: PlanOptions,
    guess_tokens: int,
    lengths: Lengths | None = None,
    *,
    memo: dict | None = None,
    keep: Plan | None = None,
) -> PoolChoice:
    """The pool for `options.max_batch` sequences, from `guess_tokens` (the pool the expected
    length gives, whose plan must fit: PlanError otherwise) up to max_batch sequences of
    max_seq_len, by the cost model (module doc). Each candidate is planned with `options`
    (objective, micro-batches) and `kv_tokens` set; the time per token is taken to grow with
    the pool (a larger pool never leaves more room for weights), so each step of it is found
    by bisection, not by planning every size. `keep`: a running plan whose stages stay
    (`planner.plan`'s, for a re-balance)."""
    if options.max_seq_len < 1 or options.max_batch < 1:
        raise PlanError("choosing a KV pool needs max_seq_len and max_batch")
    memo = {} if memo is None else memo
    plans: dict[int, Plan | None] = {}

    def planned(blocks: int) -> Plan | None:
        if blocks not in plans:
            tokens = blocks * DEFAULT_BLOCK_SIZE
            try:
                plans[blocks] = planner.plan(
                    layers,
                    cluster,
                    dataclasses.replace(options, kv_tokens=tokens),
                    memo=None if keep else memo,
                    keep=keep,
                )
            except PlanError:
                plans[blocks] = None
        return plans[blocks]

    low = max(blocks_for(guess_tokens), blocks_for(options.max_seq_len))
    high = max(low, options.max_batch * blocks_for(options.max_seq_len))
    guess = planned(low)
    if guess is None:  # the error, with its numbers
        planner.plan(
            layers,
            cluster,
            dataclasses.replace(options, kv_tokens=low * DEFAULT_BLOCK_SIZE),
            keep=keep,
        )
        raise AssertionError("unreachable: the guess's pool was planned above")

    def last_within(start: int, limit_s: float) -> int:
        """The most blocks in [start, high] whose plan fits with a time per token <= limit_s
        (`start`'s does)."""
        lo, hi = start, high
        while lo < hi:
            mid = (lo + hi + 1) // 2
            candidate = planned(mid)
            if candidate is not None and candidate.cycle_s <= limit_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def priced(blocks_list: Iterable[int]) -> list[PoolPrice]:
        return [
            price(planned(b), lengths, options.max_batch, options.max_seq_len)
            for b in sorted(set(blocks_list))
        ]

    free = last_within(low, guess.cycle_s * (1 + _SAME_STEP))  # what costs nothing more
    if lengths is None:
        chosen = last_within(free, guess.cycle_s * (1 + POOL_SHARE))
        weighed = priced([free, chosen] + ([high] if planned(high) is not None else []))
        top = weighed[-1]
        if chosen == high:
            reason = (
                f"Every one of {options.max_batch} sequences may run to max_seq_len "
                f"({options.max_seq_len}) for {_more(top.cycle_s, guess.cycle_s)} per token"
            )
        else:
            reason = (
                f"Holding every sequence to max_seq_len would cost "
                f"{_more(top.cycle_s, guess.cycle_s) if planned(high) else 'more than fits'} "
                f"per token: the largest pool within {POOL_SHARE:.0%} of the expected "
                f"length's ({options.expected_len} tokens)"
            )
        reason += "; no lengths observed yet"
        return PoolChoice(plan=planned(chosen), weighed=tuple(weighed), reason=reason)
    # Known lengths: the end of each step of the time per token, priced; the best is one of
    # them (within a step the pool holds more at the same time per token).
    ends, start, best_rate = [], low, 0.0
    while start <= high and (first := planned(start)) is not None:
        if first.cycle_s > 0 and options.max_batch / first.cycle_s <= best_rate:
            break  # no later pool beats it: at most max_batch at once, at a longer time
        end = last_within(start, first.cycle_s * (1 + _SAME_STEP))
        ends.append(end)
        best_rate = max(best_rate, priced([end])[0].tokens_per_s)
        start = end + 1
    weighed = priced(ends)
    best = max(weighed, key=lambda p: (round(p.tokens_per_s, 9), p.tokens))
    reason = f"the most predicted tokens/s for the lengths observed ({lengths.describe()})"
    return PoolChoice(
        plan=planned(best.tokens // DEFAULT_BLOCK_SIZE), weighed=tuple(weighed), reason=reason
    )


def _more(slower_s: float, base_s: float) -> str:
    return f"+{(slower_s / base_s - 1):.1%}" if base_s > 0 else "no more"
