"""Random combinations of formats and offload options against transformers (not in CI).

The tests check each format and each offload option against transformers, mostly one or two
at a time. This soak draws whole combinations at random and checks each the same way, to find
the combination nobody wrote a test for that loads and answers with other numbers.

A trial draws:
  - a family (every MoE family `make-checkpoint` writes, a few dense ones, and the families
    outside the tested list that load after the pre-launch self-check, MoE or not, from their
    default configs shrunk as that check shrinks them) and its depth;
  - a format: bf16 or float32, block FP8 (blocks that divide the widths or leave partial
    ones; scales in float32, bf16, E8M0 or uint8), compressed-tensors FP8 (per tensor,
    channel or block), or MXFP4 (gpt-oss);
  - a split into 1-3 in-process stages (the workers Ray runs, without Ray), the decoder
    layers each offloads, the unit offloaded (the layer, its experts or its MLP), the expert
    fetch (the whole unit, or routed: only the experts a step routes to, with a cache of rows
    and calls of few rows run on the host), resident quantized weights kept as stored or
    dequantized at load, and the experts' compact rows;
    or, in 2 trials of 5, the planner's split and options (as `offloadctl` plans: 1-3
    simulated GPUs of a drawn budget, expert fetch, the routed experts' cache, resident
    weights, prefetch slots, 8-bit offloaded weights);
    and, in some trials, a re-plan: a second split of as many stages with other options, to
    which the loaded workers are reconfigured (what they hold moves, the rest is read);
  - an engine: slots, micro-batches, KV blocks (a pool so tight that requests wait and are
    preempted), prefix caching over prompts that share their first tokens, decode bursts.

It checks, against transformers loading the same files in one process (same dtype, one thread;
FP8 checkpoints: an independent dequantization written as a bf16 checkpoint, as the tests do;
MXFP4: transformers' own dequantization):
  - logits of a plain batch and of a left-padded one: bitwise (again after a re-plan);
  - continuous batching (requests joining and leaving, tests/test_generation.py's schedule):
    each request's greedy tokens (in 2 of 5 under generate's own processors: a repetition
    penalty, bad words, a logit bias) those of transformers on its prompt alone. Where they part,
    the trial reports transformers' margin between its top two scores at that position: a
    batch sums in other shapes, so a near-tie (float rounding) may part; a clear margin is a bug.

A combination a worker refuses, with an error that says why, is counted, never a failure.
Exit status 1 when any trial differs beyond a near-tie, or fails without a refusal.

    python bench/combo_soak.py [--trials 40] [--minutes 30] [--seed N] [--json F]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the tests' references and harness, as they run them

import test_fp8_blocks  # noqa: E402
import test_fp8_compressed  # noqa: E402
import torch  # noqa: E402
from test_families import VOCAB, family_shape, fitting_plan, split_spec  # noqa: E402
from test_generation import (  # noqa: E402
    MAX_SEQ_LEN,
    REQUESTS,
    processors,
    prompts,
    run_joining,
)

from coordinator.config import JobConfig  # noqa: E402
from coordinator.family_check import check_family  # noqa: E402
from coordinator.planning.checkpoint import load_index  # noqa: E402
from coordinator.planning.planner import PlanOptions  # noqa: E402
from coordinator.runtime.group import stage_specs  # noqa: E402
from coordinator.runtime.inputs import check_inputs  # noqa: E402
from coordinator.small_config import shrink_config  # noqa: E402
from coordinator.tools.make_checkpoint import (  # noqa: E402
    MOE_ARCHITECTURES,
    make_checkpoint,
    perturb_constant_parameters,
    quantize_fp8,
    quantize_fp8_compressed,
)
from coordinator.tools.reference import reference_generate, reference_logits  # noqa: E402
from offload.errors import OffloadCoordinatorError, PlanError  # noqa: E402
from worker.layout import UnsupportedModelError  # noqa: E402
from worker.spec import requantized_formats  # noqa: E402
from worker.steps import Sampling  # noqa: E402
from worker.worker import StageWorker  # noqa: E402

DENSE = ("llama", "qwen3", "gemma2", "phi3")
# Families outside the tested list that load after the pre-launch self-check (float32, whole
# against split): checkpoints of their default config shrunk as that check shrinks it (2
# decoder layers, tiny widths), written by transformers, made FP8 here for the formats. The
# MoE ones, then the others (hybrids with recurrent state among them).
SELF_CHECKED_MOE = (
    "olmoe",
    "phimoe",
    "glm4_moe",
    "minimax_m2",
    "qwen3_5_moe_text",
    "afmoe",
    "jetmoe",
    "granitemoe",
    "granitemoehybrid",
    "kimi_linear",
    "flex_olmo",
    "llama4_text",
    "nemotron_h",
)
SELF_CHECKED_OTHERS = (
    "falcon",
    "opt",
    "bloom",
    "falcon_h1",
    "lfm2",
    "olmo_hybrid",
    "phi",
    "olmo",
    "olmo3",
    "cohere",
    "cohere2",
    "starcoder2",
    "stablelm",
    "exaone4",
    "glm",
    "glm4",
    "ernie4_5",
    "seed_oss",
    "smollm3",
    "apertus",
    "arcee",
    "bitnet",
    "helium",
    "qwen3_5_text",
    "ministral3",
    "doge",
    "gptj",
    "codegen",
    "gpt_neo",
    "gpt_bigcode",
    "persimmon",
    "mpt",
    "xglm",
)
SELF_CHECKED = SELF_CHECKED_MOE + SELF_CHECKED_OTHERS
# Default configs whose layers are all of one kind the check refuses (no attention layer):
# given one of each kind
SELF_CHECKED_SETTINGS = {
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]}
}
# A near-tie: transformers' own top two scores closer than this where our token parts from its
# (float32 sums in other shapes differ by ~1e-6 of the logits; bf16 rounding by ~1e-2)
NEAR_TIE = {"float32": 1e-4, "bfloat16": 0.05, "float16": 0.01}


def draw(rng: random.Random) -> dict:
    """One combination (only what the code may accept: refusals are counted, not failures)."""
    family = rng.choice(
        rng.choice((MOE_ARCHITECTURES, DENSE, SELF_CHECKED_MOE, SELF_CHECKED_OTHERS))
    )
    moe = family in MOE_ARCHITECTURES or family in SELF_CHECKED_MOE
    quant = rng.choice(
        ["none", "none", "fp8-block", "fp8-compressed"]
        + (["mxfp4"] * 2 if family == "gpt_oss" else [])
    )
    trial = dict(
        family=family,
        layers=rng.choice((3, 4)),
        dtype="bfloat16" if quant != "none" else rng.choice(("float32", "bfloat16", "float16")),
        quantization=quant,
        fp8_block=rng.choice((8, 16, 24, 32)),
        fp8_scales=rng.choice(("float32", "bfloat16", "e8m0", "uint8")),
        fp8_strategy=rng.choice(("tensor", "channel", "block")),
        stages=rng.choice((1, 2, 2, 3)),
        unit=rng.choice(("layer", "layer") + (("experts",) if moe else ()) + ("mlp",)),
        expert_fetch=rng.choice(("layer", "routed")) if moe else "layer",
        expert_cache=rng.choice((0, 0, 1, 3)),
        host_expert_rows=rng.choice((0, 0, 1, 2)),
        resident_stored=quant != "none" and rng.random() < 0.6,
        capacity=rng.choice((0, 2, 3)),  # the planner's: 0 (all) or at least top-k (2)
        micro_batches=rng.choice((0, 1)),
        num_slots=rng.choice((2, 3)),
        block_size=rng.choice((4, 8, 16)),
        tight_pool=rng.random() < 0.5,  # a KV pool of few blocks: requests wait and are preempted
        prefix_caching=rng.random() < 0.8,
        shared_prefix=rng.choice((0, 0, 4, 8)),  # the prompts' first tokens the same
        burst_steps=rng.choice((0, 0, 1, 4)),
        offload_dtype=rng.choice(("auto", "auto", "fp8", "int8")),
        seed=rng.randrange(1000),
    )
    if rng.random() < 0.4:  # the planner decides the split and the options, as offloadctl does
        trial["planned"] = dict(
            gpus=rng.choice((1, 2, 3)),
            budget=rng.uniform(0.3, 1.0),  # of a GPU's share of the model (raised until it fits)
            max_batch=trial["num_slots"],
            prefetch_step=rng.choice((1, 2)),
            expert_fetch=rng.choice(("auto", "layer", "routed")),
            expert_cache=rng.choice((-1, 0, 2)),
            resident_weights=rng.choice(("auto", "stored")) if quant != "none" else "auto",
            host_experts="off",
        )
    if quant == "fp8-compressed":
        trial["fp8_scales"] = rng.choice(("float32", "bfloat16"))
    if trial["expert_fetch"] != "routed":
        trial["expert_cache"] = trial["host_expert_rows"] = 0
    if "planned" not in trial and trial["stages"] > 1 and rng.random() < 0.3:
        # a re-plan moves the split and changes what is offloaded and how, 8-bit offload kept
        fetch = rng.choice(("layer", "routed")) if moe else "layer"
        trial["replan"] = dict(
            unit=rng.choice(("layer", "layer") + (("experts",) if moe else ()) + ("mlp",)),
            expert_fetch=fetch,
            expert_cache=rng.choice((0, 1, 3)) if fetch == "routed" else 0,
            host_expert_rows=rng.choice((0, 1, 2)) if fetch == "routed" else 0,
            resident_stored=quant != "none" and rng.random() < 0.6,
            capacity=rng.choice((0, 2, 3)),
        )
    return trial


def self_checked(trial: dict, root: Path) -> Path:
    """A checkpoint of a self-checked family as transformers writes it: its default config
    shrunk as the pre-launch check shrinks it, random weights (constant ones perturbed), in
    the trial's dtype and format."""
    from transformers import AutoConfig, AutoModelForCausalLM

    family = trial["family"]
    small = shrink_config(AutoConfig.for_model(family).to_dict())
    small = {k: v for k, v in small.items() if k not in ("model_type", "transformers_version")}
    # the tests' special tokens, below the prompts' (3 and up): generate takes a prompt's pad
    # tokens for padding and masks them (Apertus's default pad id is 3)
    small.update(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    small.update(SELF_CHECKED_SETTINGS.get(family, {}))
    config = AutoConfig.for_model(family, **small)
    torch.manual_seed(trial["seed"])
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, trial["dtype"]))
    perturb_constant_parameters(model, trial["seed"])
    model.save_pretrained(root, max_shard_size=40_000)
    block = (trial["fp8_block"], trial["fp8_block"])
    if trial["quantization"] == "fp8-block":
        quantize_fp8(root, model, block=block, scales=trial["fp8_scales"])
    elif trial["quantization"] == "fp8-compressed":
        strategy = trial["fp8_strategy"]
        quantize_fp8_compressed(
            root,
            model,
            strategy=strategy,
            block=block if strategy == "block" else None,
            scales=trial["fp8_scales"],
        )
    return root


def checkpoint(trial: dict, tmp: Path) -> tuple[Path, Path]:
    """The trial's checkpoint and the reference's files (the same, or dequantized)."""
    if trial["family"] in SELF_CHECKED:
        root = self_checked(trial, tmp / "ckpt")
    else:
        changes = {}
        if trial["quantization"] == "mxfp4":
            changes = dict(hidden_size=64, intermediate_size=64)  # MXFP4 groups of 32
        shape = family_shape(
            trial["family"],
            trial["dtype"],
            num_layers=trial["layers"],
            quantization=trial["quantization"],
            fp8_block=trial["fp8_block"],
            fp8_scales=trial["fp8_scales"],
            fp8_strategy=trial["fp8_strategy"],
            seed=trial["seed"],
            **changes,
        )
        root = make_checkpoint(tmp / "ckpt", shape)
    if trial["quantization"] == "fp8-block":
        return root, test_fp8_blocks.dequantized_copy(root, tmp / "reference")
    if trial["quantization"] == "fp8-compressed":
        return root, test_fp8_compressed.dequantized_copy(root, tmp / "reference")
    return root, root


def split(trial: dict, index, rng: random.Random) -> tuple[list[list[str]], tuple]:
    names = [layer.name for layer in index.layers]
    count = min(trial["stages"], len(names))
    cuts = sorted(rng.sample(range(1, len(names)), count - 1))
    groups = [names[a:b] for a, b in zip([0, *cuts], [*cuts, len(names)], strict=True)]
    # as the planner does: a layer moves only where it has the unit (DeepSeek's dense first
    # layer has no experts)
    offloaded = tuple(
        layer.name
        for layer in index.layers
        if layer.kind == "decoder" and layer.unit_bytes(trial["unit"]) and rng.random() < 0.6
    )
    return groups, offloaded


def specs_of(trial: dict, index, groups, offloaded) -> list:
    return [
        dataclasses.replace(
            split_spec(index, stage, groups, offloaded, trial["unit"]),
            offload_dtype=trial["offload_dtype"],
            expert_fetch=trial["expert_fetch"],
            expert_cache=trial["expert_cache"],
            host_expert_rows=trial["host_expert_rows"],
            resident_stored=trial["resident_stored"],
            stored_expert_capacity=trial["capacity"] if trial["resident_stored"] else 0,
        )
        for stage in range(len(groups))
    ]


def replanned(trial: dict, index, workers, rng: random.Random) -> None:
    """The workers given a second split of as many stages, with the re-plan's options, as a
    re-plan reconfigures them: layers they hold move, the others are read."""
    again = dict(trial, **trial["replan"], stages=len(workers))
    groups, offloaded = split(again, index, rng)
    trial["replan"].update(groups=groups, offloaded=offloaded)
    for worker, spec in zip(workers, specs_of(again, index, groups, offloaded), strict=True):
        for chunk in worker.reconfigure(spec):
            worker.load_chunk(chunk)
        worker.finish_load()


def planned_specs(trial: dict, index) -> list:
    """The planner's stages on `gpus` equal simulated GPUs of the drawn budget, raised until a
    plan fits (tests/test_families.py's `fitting_plan`), with the drawn options; their specs
    as `offloadctl` makes them."""
    drawn = trial["planned"]
    options = PlanOptions(
        max_batch=drawn["max_batch"],
        prefetch_step=drawn["prefetch_step"],
        offload_dtype=trial["offload_dtype"],
        expert_fetch=drawn["expert_fetch"],
        expert_cache=drawn["expert_cache"],
        resident_weights=drawn["resident_weights"],
        host_experts=drawn["host_experts"],
    )
    budget = int(sum(layer.nbytes for layer in index.layers) * drawn["budget"] / drawn["gpus"])
    the_plan = fitting_plan(index, options, drawn["gpus"], budget, tries=64)
    if the_plan is not None:
        return stage_specs(JobConfig(checkpoint=str(index.root)), index, the_plan, {})
    raise PlanError(f"no plan from a budget of {budget} bytes per GPU up")


def described_spec(spec) -> str:
    """A stage spec in a line: its layers and what the plan made of them."""
    names = [layer.name for layer in spec.layers]
    parts = [f"{names[0]}..{names[-1]}"]
    if spec.offloaded:
        parts.append(f"offloads {','.join(spec.offloaded)} ({spec.offload_unit})")
    if spec.expert_fetch == "routed":
        parts.append(f"routed cache {spec.expert_cache} host rows {spec.host_expert_rows}")
    if spec.resident_stored:
        parts.append(f"stored capacity {spec.stored_expert_capacity}")
    return " ".join(parts)


def forward(workers, ids, mask=None):
    x, mask, positions, keep = check_inputs(ids, mask, 0, VOCAB)
    for worker in workers:
        x = worker.forward(x, mask, positions, keep)
    return x


def rounded(trial: dict, workers) -> dict:
    """The weights the workers keep in 8 bits by `offload_dtype` (fp8, int8), with their
    formats: the reference round-trips the same ones (`reference_logits`' `quantized`)."""
    if trial["offload_dtype"] == "auto":
        return {}
    names = {}
    for worker in workers:
        spec = worker.spec
        for layer in spec.layers:
            if layer.name in spec.offloaded:
                tensors = layer.unit_tensors(spec.offload_unit)
                names.update(requantized_formats(tensors, trial["offload_dtype"]))
    return names


def penalties(rng: random.Random) -> Sampling:
    """Greedy, and in 2 requests of 5 with generate's own processors (transformers applies
    the same ones): a repetition penalty, words never to end on, a bias on a token."""
    if rng.random() >= 0.4:
        return Sampling()
    words = tuple(
        tuple(rng.randrange(3, VOCAB) for _ in range(rng.choice((1, 2))))
        for _ in range(rng.choice((0, 1, 2)))
    )
    bias = tuple(
        (rng.randrange(3, VOCAB), rng.choice((-4.0, 3.0, 8.0))) for _ in range(rng.choice((0, 1)))
    )
    return Sampling(
        repetition_penalty=rng.choice((1.0, 0.7, 1.3, 1.8)), bad_words=words, logit_bias=bias
    )


def asked_for(sampling: Sampling) -> str:
    """The settings a request changed from greedy's defaults."""
    default = Sampling()
    changed = [
        f"{f.name}={getattr(sampling, f.name)}"
        for f in dataclasses.fields(sampling)
        if getattr(sampling, f.name) != getattr(default, f.name)
    ]
    return ", ".join(changed) or "greedy"


def theirs(reference: Path, dtype: str, prompt, new: int, sampling: Sampling, quantized: dict):
    """transformers' greedy tokens for `prompt` alone under `sampling`'s processors, and at
    each the gap between its top two scores after them."""
    out = reference_generate(
        str(reference),
        torch.tensor([prompt]),
        dtype=dtype,
        num_threads=1,
        quantized=quantized,
        max_new_tokens=new,
        do_sample=False,
        eos_token_id=None,
        **processors(sampling),
        output_scores=True,
        return_dict_in_generate=True,
    )
    gaps = []
    for scores in out.scores:
        top = scores[0].float().topk(2).values
        gaps.append(float(top[0] - top[1]))
    return out.sequences[0, len(prompt) :].tolist(), gaps


def run_trial(trial: dict, rng: random.Random) -> dict:
    with tempfile.TemporaryDirectory(prefix="combo-") as tmp:
        root, reference = checkpoint(trial, Path(tmp))
        index = load_index(root)
        if trial["family"] in SELF_CHECKED:  # as a launch does: the pre-launch check first
            try:
                check_family(index.config)
            except UnsupportedModelError as error:
                return {"result": "refused", "why": f"family check: {str(error)[:300]}"}
        if "planned" in trial:
            try:
                specs = planned_specs(trial, index)
            except PlanError as error:
                return {"result": "no plan", "why": str(error).splitlines()[0][:300]}
            trial.update(plan=[described_spec(spec) for spec in specs])
            workers = [StageWorker(spec, device="cpu", num_threads=1) for spec in specs]
        else:
            groups, offloaded = split(trial, index, rng)
            trial.update(groups=groups, offloaded=offloaded)
            specs = specs_of(trial, index, groups, offloaded)
            workers = [StageWorker(spec, device="cpu", num_threads=1) for spec in specs]
        try:
            try:
                for worker in workers:
                    worker.load()
            except OffloadCoordinatorError as error:
                return {"result": "refused", "why": str(error).splitlines()[0][:300]}
            g = torch.Generator().manual_seed(trial["seed"])
            ids = torch.randint(3, VOCAB, (2, 9), generator=g)
            mask = torch.ones_like(ids)
            mask[1, :3] = 0
            positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
            plain, padded = forward(workers, ids), forward(workers, ids, mask)
            checked = [("", plain, padded, rounded(trial, workers))]
            if "replan" in trial:
                try:
                    replanned(trial, index, workers, rng)
                except OffloadCoordinatorError as error:
                    return {"result": "refused", "why": f"re-plan: {str(error).splitlines()[0]}"}
                again = forward(workers, ids), forward(workers, ids, mask)
                checked.append(("after the re-plan: ", *again, rounded(trial, workers)))
            asked = prompts(seed=trial["seed"])
            samplings = [penalties(rng) for _ in asked]
            trial["penalized"] = sum(s != Sampling() for s in samplings)
            for prompt in asked[1:]:
                shared = min(trial["shared_prefix"], len(prompt) - 1, len(asked[0]))
                prompt[:shared] = asked[0][:shared]
            longest = -(-MAX_SEQ_LEN // trial["block_size"])  # blocks of the longest sequence
            ours, engine = run_joining(
                SimpleNamespace(workers=workers, index=index),
                asked,
                samplings=samplings,
                num_slots=trial["num_slots"],
                micro_batches=trial["micro_batches"],
                block_size=trial["block_size"],
                num_blocks=longest + rng.randrange(longest // 2 + 1) if trial["tight_pool"] else 0,
                prefix_caching=trial["prefix_caching"],
                burst_steps=trial["burst_steps"],
            )
            stats = engine.stats
        finally:
            for worker in workers:
                worker.close()
        dtype = index.dtype
        names = checked[-1][3]  # the weights kept in 8 bits as the engine ran
        out: dict = {
            "result": "equal",
            "problems": [],
            "preempted": getattr(stats, "preemptions", None),
            "cached": getattr(stats, "prefix_hits", None),
        }
        for when, plain, padded, rounded_then in checked:
            expected = reference_logits(
                str(reference), ids, dtype=dtype, num_threads=1, quantized=rounded_then
            )
            expected_padded = reference_logits(
                str(reference),
                ids,
                dtype=dtype,
                num_threads=1,
                quantized=rounded_then,
                attention_mask=mask,
                position_ids=positions,
            )
            for what, got, want, kwargs in (
                ("plain", plain, expected, {}),
                (
                    "padded",
                    padded,
                    expected_padded,
                    dict(attention_mask=mask, position_ids=positions),
                ),
            ):
                if torch.equal(got, want):
                    continue
                diff = (got.float() - want.float()).abs().max().item()
                # a plain call caches, a stage's forward does not: CodeGen's numbers differ so
                uncached = reference_logits(
                    str(reference),
                    ids,
                    dtype=dtype,
                    num_threads=1,
                    quantized=rounded_then,
                    use_cache=False,
                    **kwargs,
                )
                if torch.equal(got, uncached):
                    out.setdefault("notes", []).append(
                        f"{when}{what} logits those of transformers' forward without a cache "
                        f"({diff:.3g} from its plain call's)"
                    )
                else:
                    out["problems"].append(f"{when}{what} logits {diff:.3g} off")
        for i, (prompt, (_, new, _), tokens, sampling) in enumerate(
            zip(asked, REQUESTS, ours, samplings, strict=True)
        ):
            expected, gaps = theirs(reference, dtype, prompt, new, sampling, names)
            if tokens == expected:
                continue
            parted = (k for k, (a, b) in enumerate(zip(tokens, expected, strict=False)) if a != b)
            at = next(parted, min(len(tokens), len(expected)))  # else one stopped early
            gap = gaps[at] if at < len(gaps) else float("inf")
            what = (
                f"request {i} ({asked_for(sampling)}) parts at token {at} (transformers' top-2 margin "
                f"{gap:.3g})"
            )
            if gap < NEAR_TIE[dtype]:
                out.setdefault("near_ties", []).append(what)
            else:
                out["problems"].append(what)
        if out["problems"]:
            out["result"] = "differs"
        return out


def described(trial: dict) -> dict:
    """The trial's fields that mattered (no FP8 fields for a bf16 checkpoint, and so on)."""
    skip = {"groups"}
    if "planned" in trial:  # the plan's, not the draw's
        skip |= {"stages", "unit", "expert_fetch", "expert_cache", "host_expert_rows"}
        skip |= {"resident_stored", "capacity", "offloaded"}
    if trial["quantization"] not in ("fp8-block", "fp8-compressed"):
        skip |= {"fp8_block", "fp8_scales", "fp8_strategy"}
    elif trial["quantization"] == "fp8-block":
        skip.add("fp8_strategy")
    elif trial["fp8_strategy"] != "block":
        skip.add("fp8_block")
    if trial["expert_fetch"] != "routed":
        skip |= {"expert_cache", "host_expert_rows"}
    if not trial["resident_stored"]:
        skip.add("capacity")
    if "plan" in trial:  # a plan's stages, one line each: shown below the trial
        skip.add("plan")
    if trial["offload_dtype"] == "auto":
        skip.add("offload_dtype")
    return {k: v for k, v in trial.items() if k not in skip}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--minutes", type=float, default=30.0, help="stop starting trials after")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    rng = random.Random(seed)
    torch.set_num_threads(1)
    print(f"seed {seed}", flush=True)
    records, start = [], time.monotonic()
    for number in range(args.trials):
        if time.monotonic() - start > args.minutes * 60:
            break
        trial = draw(rng)
        began = time.monotonic()
        try:
            outcome = run_trial(trial, rng)
        except Exception:  # a failure without a refusal: the trial's traceback
            outcome = {"result": "error", "why": traceback.format_exc(limit=6)}
        outcome["s"] = round(time.monotonic() - began, 1)
        records.append({"trial": trial, **outcome})
        shown = " ".join(f"{k}={v}" for k, v in described(trial).items())
        seen = f"preempted {outcome.get('preempted')} cache hits {outcome.get('cached')}"
        print(
            f"{number:3d} {outcome['result']:8s} {outcome['s']:5.1f}s {shown} ({seen})", flush=True
        )
        for key in ("plan", "why", "problems", "near_ties", "notes"):
            value = trial.get(key) if key == "plan" else outcome.get(key)
            if value:
                print(f"    {key}: {value}", flush=True)
    counts: dict[str, int] = {}
    for record in records:
        counts[record["result"]] = counts.get(record["result"], 0) + 1
    print(f"seed {seed}: {len(records)} trials in {time.monotonic() - start:.0f} s: {counts}")
    if args.json:
        args.json.write_text(
            json.dumps({"seed": seed, "counts": counts, "trials": records}, indent=1, default=str)
        )
    return 1 if counts.get("differs") or counts.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
