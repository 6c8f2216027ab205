"""Families outside the tested list, checked in the driver before any worker starts.

`worker.layout.TESTED_FAMILIES` are compared with transformers in CI. Other decoder-only families
the checkpoint index accepts could fail only inside a worker, after Ray and every worker started
(Falcon's blocks return tuples; OPT's position embedding takes `position_ids`), or differ with no
error. So the driver first runs the family's own class, from the checkpoint's config shrunk to 2
layers and tiny widths (structural flags kept: sliding windows, rope type, tying, MoE routing),
random float32 weights, in this process on the CPU: whole, and split into pass-through stages as
workers build them (`worker.stage.Stage`), for several splits, through a plain forward and a
left-padded one (as `job.forward` sends them), logits bitwise equal; then as the engine
generates, through the workers' own `BatchRunner.step` (`worker.batched`: two prompts of
different lengths as left-padded rows of one prefill step, then greedy decode steps, each stage
in its KV pool, each row at its own positions with its own masks, no 2D attention mask), each
row's logits within a float32
tolerance of the whole model's on that prompt alone, same argmax (a padded batch sums in other
shapes: never bitwise). That catches a family reading what batched steps do not give (ALiBi or
positions from the 2D mask, masks built other than by `create_causal_mask`). Both pass: it loads
(the CLI says untested, self-checked). Else, or if the check raises, `FamilyCheckError` (a user
error, exit 2) names the module that did not pass through, or the batched step and row that
differ. Tested families skip the check. Verdicts (of both parts) are cached per (family, shrunk
config) in this process. No Ray: `plan` runs it too.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import nn

from coordinator.small_config import NUM_LAYERS, VOCAB, shrink_config
from worker.batched import BatchRunner
from worker.layout import (
    TESTED_FAMILIES,
    UnsupportedModelError,
    find_layout,
    hf_config_from_dict,
    measure_cache_writes,
    model_class_for,
)
from worker.stage import Stage
from worker.steps import StepRows

SEED = 0
BATCH, PROMPT, PAD, DECODE_STEPS = 2, 7, 2, 2
CHECK_OWNER = ("family-check", 0)  # the check's own stages: it is their only engine
PROMPTS = (7, 4)  # the batched check's prompt lengths: the shorter row is left-padded
# Batched rows against each prompt alone: float32 sums in other shapes. Measured (1 thread, max
# abs logit difference over the prefill and 2 decode steps, every split): 1.5e-7 for gemma2, at
# most 1.1e-7 for the other tested families and Falcon / OPT (logits up to 0.6); a decode
# position one too far (OPT) or a mask showing unwritten slot keys (Falcon) gives 0.035.
ATOL = RTOL = 1e-4


class FamilyCheckError(UnsupportedModelError):
    """An untested family whose pipeline split or batched generation did not reproduce its whole
    model in the pre-launch check; the message names the family and the module or step."""


_verdicts: dict[tuple, str | None] = {}  # (family, shrunk config, attention) -> refusal or None
_lock = threading.Lock()


def check_family(config: dict, *, attn_implementation: str | None = None) -> bool:
    """Check config.json's family before launch (see the module doc): False for a tested family
    (not checked), True for an untested one that passed; FamilyCheckError when it failed. When
    the shrunk copy cannot be made (its coupled widths are not the ones this shrinks), the
    check runs a layer of each kind at the config's own widths instead, if they fit
    `WIDE_CHECK_BYTES`: a shrink problem is never reported as the model's."""
    family = config.get("model_type")
    if family in TESTED_FAMILIES:
        return False
    try:
        verdict = _verdict(shrink_config(config), attn_implementation)
    except Exception as exc:  # any surprise in config.json: refused in one line, no traceback
        verdict = (
            f"{family}: the pre-launch check of this untested family cannot "
            f"shrink its config ({_describe(exc)})"
        )
    if verdict is not None and (CANNOT_BUILD in verdict or CANNOT_SHRINK in verdict):
        verdict = _at_real_widths(config, attn_implementation, verdict)
    if verdict is not None:
        raise FamilyCheckError(verdict)
    return True


WIDE_CHECK_BYTES = 2 << 30  # a layer of each kind at the config's widths, float32, in the driver
CANNOT_BUILD = "cannot build a"
CANNOT_SHRINK = "cannot shrink its config"


def _verdict(small: dict, attn_implementation: str | None) -> str | None:
    key = (
        small["model_type"],
        json.dumps(small, sort_keys=True, default=repr),
        attn_implementation,
    )
    with _lock:  # two jobs launched at once from one driver: checked once
        if key not in _verdicts:
            _verdicts[key] = _check(small, attn_implementation)
        return _verdicts[key]


def _at_real_widths(config: dict, attn_implementation: str | None, shrunk: str) -> str | None:
    """The check on a layer of each kind at the config's own widths (depth, windows and vocabulary
    shrunk only), when the shrunk copy could not be made: None when that passes, its refusal
    when it does not, and the shrink's refusal with the size when it is too large to run here."""
    try:
        wide = shrink_config(config, widths=False)
        size = _float32_bytes(wide)
    except Exception:
        return shrunk
    if size > WIDE_CHECK_BYTES:
        return (
            f"{shrunk}; at its own widths a copy of a layer of each kind takes "
            f"{size / 2**30:.1f} GiB in float32, more than the check's "
            f"{WIDE_CHECK_BYTES / 2**30:.0f} GiB"
        )
    return _verdict(wide, attn_implementation)


def _float32_bytes(config: dict) -> int:
    """The parameters' bytes of `config`'s model in float32, counted on the meta device."""
    from worker.layout import build_meta_model

    model = build_meta_model(hf_config_from_dict(config, dtype=torch.float32))
    return sum(p.numel() for p in model.parameters()) * 4


_continues: dict[str, bool] = {}  # shrunk config -> continues_chunks


def continues_chunks(config: dict) -> bool:
    """Whether the family's own code continues its recurrent state over a second prompt chunk
    as over the whole prompt (a model with recurrent state: the engine chunks its prompts only
    then): its shrunk copy, random float32 weights, over 11 tokens whole and as 8 then 3 through
    transformers' own cache, logits within float32 rounding. Qwen3-Next and Bamba do (1e-7);
    Jamba does not (0.02). False when it cannot tell (the prompts then go whole, which is always
    right). Kept per config in this process."""
    from transformers import DynamicCache

    try:
        small = shrink_config(config)
    except Exception:
        return False
    key = json.dumps(small, sort_keys=True, default=repr)
    if key not in _continues:
        try:
            with _quiet_and_seeded(), torch.inference_mode():
                model = _random_model(hf_config_from_dict(small, dtype=torch.float32))
                ids = torch.randint(
                    2, VOCAB, (1, 11), generator=torch.Generator().manual_seed(SEED)
                )
                whole = model(input_ids=ids).logits
                cache, parts = DynamicCache(config=model.config), []
                for start, end in ((0, 8), (8, 11)):
                    positions = torch.arange(start, end)[None]
                    parts.append(
                        model(
                            input_ids=ids[:, start:end],
                            position_ids=positions,
                            past_key_values=cache,
                            use_cache=True,
                        ).logits
                    )
                _continues[key] = torch.allclose(
                    torch.cat(parts, dim=1), whole, atol=ATOL, rtol=RTOL
                )
        except Exception:
            _continues[key] = False
    return _continues[key]


@dataclass(slots=True)
class _Call:
    """One call of a pipeline layer's module during a step: what came in and went out."""

    stage: int  # -1: the whole model
    path: str
    module: nn.Module
    held: bool  # the stage's own module (compared by value), not a stand-in (by kind)
    input: object
    output: object


def _check(small: dict, attn_implementation: str | None) -> str | None:
    """The refusal (one line) when the split or its batched generation differs, else None."""
    family = small["model_type"]
    failed = f"{family}: the pipeline split does not reproduce the whole model"

    def hf_config():  # a fresh config per model, as each worker builds its own
        return hf_config_from_dict(
            small, dtype=torch.float32, attn_implementation=attn_implementation
        )

    with _quiet_and_seeded():
        try:
            whole = _random_model(hf_config())
            layout = find_layout(whole)
        except Exception as exc:
            return (
                f"{family}: the pre-launch check of this untested family cannot build a "
                f"{NUM_LAYERS}-layer copy of its model ({_describe(exc)})"
            )
        weights = whole.state_dict()
        names = layout.layer_names()
        # Three stages (embed+layer 0 | layer 1 | head), two with other boundaries, and one
        # (a job on one GPU): each stage boundary a model's forward may see.
        splits = [[names[:2], names[2:-1], names[-1:]], [names[:1], names[1:]], [names]]
        built: list[tuple[str, list[Stage]]] = []  # (label, stages) of the splits that passed
        for split in splits:
            split = [group for group in split if group]
            label = " | ".join("+".join(group) for group in split)
            try:
                stages = [_stage(hf_config(), group, weights) for group in split]
                refusal = _compare(whole, stages, layout)
            except Exception as exc:  # building a stage, or the whole model's own forward
                refusal = f"the check raised {_describe(exc)}"
            if refusal is not None:
                return f"{failed} ({refusal}; stages {label})"
            built.append((label, stages))
        try:
            refusal = _check_batched(whole, built)
        except Exception as exc:  # the whole model's own forward on a prompt alone
            refusal = f"the check raised {_describe(exc)}"
        if refusal is not None:
            return f"{family}: batched generation does not reproduce the model ({refusal})"
    return None


def _random_model(hf_config) -> nn.Module:
    """The whole model of `hf_config` in float32, its random weights seeded (by the caller's
    `_quiet_and_seeded`), norms and biases perturbed so they count too, in eval mode."""
    from coordinator.tools.make_checkpoint import perturb_constant_parameters

    model = model_class_for(hf_config)._from_config(hf_config, dtype=torch.float32)
    perturb_constant_parameters(model, SEED)
    return model.eval()


def _stage(hf_config, layer_names: list[str], weights: dict[str, torch.Tensor]) -> Stage:
    """A stage as a worker builds it (held modules given memory, buffers initialised as
    `from_pretrained` does), its tensors then filled from the whole model's."""
    stage = Stage(hf_config, layer_names)
    for module in stage.layer_modules().values():
        module.to_empty(device="cpu")
    stage.init_buffers(torch.device("cpu"))
    with torch.no_grad():
        for name, tensor in stage.model.state_dict(keep_vars=True).items():
            tensor.copy_(weights[name])
    return stage


def _compare(whole: nn.Module, stages: list[Stage], layout) -> str | None:
    """Run the forwards `job.forward` sends (plain, and left-padded rows with their mask and
    positions) through the whole model and through `stages`; where they first differ.
    Generation is checked through the workers' own batched steps (`_check_batched`)."""
    generator = torch.Generator().manual_seed(SEED)
    ids = torch.randint(2, VOCAB, (BATCH, PROMPT), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :PAD] = 0  # a left-padded row
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    stage_modules = [
        entry
        for s, stage in enumerate(stages)
        for entry in _layer_modules(s, stage.model, stage.layout, stage.layer_names)
    ]
    for what, m, p in (("plain forward", None, None), ("left-padded forward", mask, positions)):
        calls: list[_Call] = []
        with _recording(_layer_modules(-1, whole, layout, None), calls), torch.inference_mode():
            expected = whole(
                input_ids=ids, attention_mask=m, position_ids=p, use_cache=False
            ).logits
        reference = {call.path: call for call in calls}
        calls.clear()
        got, error = ids, None
        with _recording(stage_modules, calls), torch.inference_mode():
            try:
                for stage in stages:
                    got = stage(got, attention_mask=m, position_ids=p)
            except Exception as exc:
                error = exc
        if error is not None or not torch.equal(got, expected):
            return f"{_first_difference(calls, reference, stages, error)}, {what}"
    return None


def _check_batched(whole: nn.Module, built: list[tuple[str, list[Stage]]]) -> str | None:
    """Where generation through batched steps first differs from the whole model run on each
    prompt alone (see the module doc): the step, split and row, or what raised; else None."""
    generator = torch.Generator().manual_seed(SEED)
    prompts = [torch.randint(2, VOCAB, (n,), generator=generator) for n in PROMPTS]
    alone = [_alone(whole, prompt) for prompt in prompts]
    for label, stages in built:
        steps = _batched_steps(stages, prompts, alone)
        for n in range(DECODE_STEPS + 1):
            what = f"decode step {n}" if n else "prefill"
            try:
                got = next(steps)
            except Exception as exc:
                return (
                    f"{what}: {_raising_module(exc, stages)} raised {_describe(exc)}; "
                    f"stages {label}"
                )
            for row, expected in enumerate(alone):
                want = expected[n]
                if not (
                    torch.allclose(got[row], want, atol=ATOL, rtol=RTOL)
                    and torch.equal(got[row].argmax(), want.argmax())
                ):
                    diff = (got[row] - want).abs().max().item()
                    return (
                        f"{what}, row {row} (its {len(prompts[row])}-token prompt): logits "
                        f"differ by up to {diff:.3g}; stages {label}"
                    )
    return None


def _alone(whole: nn.Module, prompt: torch.Tensor) -> list[torch.Tensor]:
    """The whole model on `prompt` alone, as plain transformers generates (its own cache, no
    padding, each token's position given as `generate` gives it: Bamba's cached decode
    without them sits 9e-5 from its own uncached forward): the last position's logits of the
    prefill and of each greedy decode step."""
    from transformers import DynamicCache

    cache, x, out = DynamicCache(config=whole.config), prompt[None], []
    with torch.inference_mode():
        for _ in range(DECODE_STEPS + 1):
            start = len(prompt) + len(out) - x.shape[1]
            positions = torch.arange(start, start + x.shape[1])[None]
            logits = whole(
                input_ids=x, position_ids=positions, past_key_values=cache, use_cache=True
            ).logits
            out.append(logits[0, -1])
            x = out[-1].argmax().reshape(1, 1)
    return out


def _batched_steps(
    stages: list[Stage], prompts: list[torch.Tensor], alone: list[list[torch.Tensor]]
) -> Iterator[torch.Tensor]:
    """Each step's last-position logits (rows, vocab) through `stages` as `BatchRunner.step`
    runs them: one prefill of the prompts as rows left-padded with token 0 (as the engine pads
    them), then decode steps feeding each row the token its prompt chose alone, so both sides
    see the same inputs. Rows sit in slots of the other order, as the engine may assign them.
    A model with recurrent state takes no padding (`Scheduler(uniform=True)`): each prompt is
    then its own prefill step, as the engine plans them, and the decodes run together."""
    width = max(len(prompt) for prompt in prompts)
    slots = tuple(reversed(range(len(prompts))))
    rows = StepRows.in_slots(
        slots,
        (0,) * len(prompts),
        tuple(len(prompt) for prompt in prompts),
        width,
        num_slots=len(prompts),
        max_seq_len=width + DECODE_STEPS + 1,
        owner=CHECK_OWNER,
    )
    runners = [BatchRunner(torch.device("cpu")) for _ in stages]  # as each worker steps
    for runner in runners:
        runner.claim(CHECK_OWNER)

    def step(rows: StepRows, x: torch.Tensor) -> torch.Tensor:
        for stage, runner in zip(stages, runners, strict=True):
            x = runner.step(stage, rows, x, None)  # the last stage: its logits, no draw
        return x

    if measure_cache_writes(stages[0].model.config).recurrent:
        yield torch.cat(
            [
                step(
                    replace(
                        rows,
                        slots=(slot,),
                        starts=(0,),
                        counts=(len(p),),
                        width=len(p),
                        tables=(table,),
                    ),
                    p[None],
                )
                for slot, p, table in zip(slots, prompts, rows.tables, strict=True)
            ]
        )
    else:
        x = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            x[row, width - len(prompt) :] = prompt
        yield step(rows, x)
    for n in range(1, DECODE_STEPS + 1):
        rows = rows.advanced()
        yield step(rows, torch.stack([expected[n - 1].argmax() for expected in alone])[:, None])


def _first_difference(
    calls: list[_Call], reference: dict[str, _Call], stages: list[Stage], error: Exception | None
) -> str:
    """The first module, in the order the stages ran them, whose input or output differs from
    the whole model's (a stand-in: whose kind of output differs), else where `error` arose."""
    raised = f"; then {_describe(error)}" if error is not None else ""
    for call in calls:
        ref = reference.get(call.path)
        if ref is None:
            continue
        name = f"stage {call.stage}, module {call.path} / {type(call.module).__name__}"
        if call.held:
            if not _same(call.input, ref.input):
                return f"{name}: its input differs from the whole model's{raised}"
            if not _same(call.output, ref.output):
                return f"{name}: its output differs from the whole model's{raised}"
        elif _kind(call.output) != _kind(ref.output):
            return (
                f"{name} returns {_kind(call.output)} where {type(ref.module).__name__} "
                f"returns {_kind(ref.output)}{raised}"
            )
    if error is not None:
        return f"{_raising_module(error, stages)} raised {_describe(error)}"
    return "the logits differ while every module's output matched"


def _raising_module(error: Exception, stages: list[Stage]) -> str:
    """'stage S, module PATH / Class' of the innermost module of `stages` in the traceback."""
    where = {
        id(m): (s, path, m)
        for s, stage in enumerate(stages)
        for path, m in stage.model.named_modules()
    }
    found = None
    tb = error.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if id(owner) in where:
            found = where[id(owner)]
        tb = tb.tb_next
    if found is None:
        return "the split"
    s, path, module = found
    return f"stage {s}, module {path or '(the model)'} / {type(module).__name__}"


def _layer_modules(stage: int, model: nn.Module, layout, held: list[str] | None) -> list[tuple]:
    """(stage, path, module, held) of every pipeline-layer module of `model`, stand-ins
    included; `held`: the layers that are the stage's own (None: all, the whole model)."""
    return [
        (stage, path, model.get_submodule(path), held is None or layer in held)
        for layer in layout.layer_names()
        for path in layout.module_paths(layer)
    ]


@contextmanager
def _recording(modules: list[tuple], calls: list[_Call]) -> Iterator[None]:
    """Append a `_Call` to `calls` for each of `modules` (see `_layer_modules`) as it runs: its
    hidden-states input (after earlier pre-hooks, such as the stage's restoring of received
    hidden states) and its output, cloned (a later module may change them in place)."""
    handles = []
    try:
        for stage, path, module, held in modules:
            seen: dict[str, object] = {}

            def before(module, args, kwargs, seen=seen) -> None:
                first = next(iter(kwargs.values()), None)
                seen["input"] = _clone(args[0] if args else kwargs.get("hidden_states", first))

            def after(
                module, args, kwargs, output, seen=seen, stage=stage, path=path, held=held
            ) -> None:
                calls.append(
                    _Call(
                        stage=stage,
                        path=path,
                        module=module,
                        held=held,
                        input=seen.pop("input", None),
                        output=_clone(output),
                    )
                )

            handles += [
                module.register_forward_pre_hook(before, with_kwargs=True),
                module.register_forward_hook(after, with_kwargs=True),
            ]
        yield
    finally:
        for handle in handles:
            handle.remove()


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    return value


def _kind(value) -> str:
    if isinstance(value, torch.Tensor):
        return "a tensor"
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}"
    return f"a {type(value).__name__}"


def _same(a, b) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and not isinstance(a, torch.Tensor | tuple)


def _describe(exc: BaseException) -> str:
    """`Type: message` on one line (transformers' validation errors put the reason on line 2)."""
    text = " ".join(line.strip() for line in str(exc).strip().splitlines()[:3])
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


@contextmanager
def _quiet_and_seeded() -> Iterator[None]:
    """Seeded weights without touching the caller's random state, one thread (the check's
    models are tiny, and the same thread count for both sides), no transformers chatter."""
    from transformers.utils import logging as hf_logging

    threads, verbosity = torch.get_num_threads(), hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(SEED)
            yield
    finally:
        torch.set_num_threads(threads)
        hf_logging.set_verbosity(verbosity)


__all__ = ["FamilyCheckError", "check_family", "shrink_config"]
