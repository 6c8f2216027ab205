"""Families outside the tested list are checked in the driver before any worker starts
(coordinator/family_check.py): the model's own class, shrunk, run whole and split into
pass-through stages, logits bitwise equal, or a one-line refusal naming the module.

Falcon and OPT, as transformers' `save_pretrained` writes them, used to fail inside a Ray
worker after every worker had started (Falcon's blocks return `(hidden, attn_weights)`; OPT's
learned position embedding takes `position_ids`, and OPT registers its final norm before its
blocks). They now pass the check and load bitwise equal to transformers; the tests also show
that the old stand-ins are refused before launch with the module named, and that the check's
batched generation part (the engine's steps, against each prompt alone) refuses a wrong batched
path or unrouted masks naming the step. In-process workers as in test_families.py; one
`offloadctl run` starts Ray.
"""

from __future__ import annotations

import pytest
import torch
from test_families import VOCAB, Pipeline, family_shape, reference
from test_generation import MAX_SEQ_LEN, alone, generate_each

import worker.batch_view
import worker.batched
import worker.stage
from coordinator import family_check
from coordinator.cli import EXIT_ERROR, main
from coordinator.family_check import FamilyCheckError, check_family, shrink_config
from coordinator.planning.checkpoint import CheckpointIndex, load_index
from worker.layout import TESTED_FAMILIES, UnsupportedModelError

TINY = dict(
    num_hidden_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
MLA = dict(
    num_key_value_heads=4,
    intermediate_size=64,
    moe_intermediate_size=32,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    topk_group=1,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
)
MAMBA2 = dict(  # Mamba-2 mixers: 8 heads x 8 = 2 x hidden, a small state, chunks of 4
    num_key_value_heads=2,
    intermediate_size=48,
    mamba_n_heads=8,
    mamba_d_head=8,
    mamba_d_state=16,
    mamba_chunk_size=4,
)
CASES = {  # name -> (config class, its settings, dtype written)
    # Falcon-7B's layout (multi-query, parallel attention), in bfloat16 as it is published
    "falcon": (
        "FalconConfig",
        dict(
            new_decoder_architecture=False, multi_query=True, parallel_attn=True, ffn_hidden_size=48
        ),
        "bfloat16",
    ),
    # Falcon-40B/180B's: grouped KV heads, two layer norms in parallel
    "falcon-new": (
        "FalconConfig",
        dict(
            new_decoder_architecture=True,
            num_kv_heads=2,
            num_ln_in_parallel_attn=2,
            ffn_hidden_size=48,
        ),
        "float32",
    ),
    "opt": ("OPTConfig", dict(ffn_dim=48, word_embed_proj_dim=32, dropout=0.0), "float32"),
    # DeepSeek-V3's multi-head latent attention with a query/key head of 16 + 8 dims and
    # values of 12 (make-checkpoint's tested shape has them equal), routed and shared
    # experts, the first layer dense, in bfloat16 as it is published
    "deepseek_v3": ("DeepseekV3Config", {**MLA, "q_lora_rank": 16, "n_group": 1}, "bfloat16"),
    # DeepSeek-V2-Lite's: no query compression, greedy routing over every expert
    "deepseek_v2": (
        "DeepseekV2Config",
        {**MLA, "q_lora_rank": None, "topk_method": "greedy", "n_group": 1},
        "float32",
    ),
    # masks built their own way: BLOOM's ALiBi biases (from the keys' count), Llama 4's
    # chunked attention (a window of 4 the prompts outrun) and NoPE layers, in bfloat16
    "bloom": ("BloomConfig", dict(hidden_dropout=0.0, attention_dropout=0.0), "bfloat16"),
    "llama4_text": (
        "Llama4TextConfig",
        dict(
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=48,
            intermediate_size_mlp=64,
            num_local_experts=4,
            num_experts_per_tok=1,
            attention_chunk_size=4,
            interleave_moe_layer_step=2,
        ),
        "bfloat16",
    ),
    # hybrids with recurrent state: Falcon-H1 (attention and Mamba-2 in parallel in every
    # layer), Granite 4 (Mamba-2 and attention layers, experts), LFM2 (short convolutions)
    "falcon_h1": ("FalconH1Config", {**MAMBA2, "mamba_d_ssm": 64}, "float32"),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        {
            **MAMBA2,
            "layer_types": ["mamba", "attention", "mamba", "mamba"],
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": 48,
        },
        "float32",
    ),
    "lfm2": (
        "Lfm2Config",
        dict(
            num_key_value_heads=2,
            intermediate_size=48,
            layer_types=["conv", "full_attention", "conv", "conv"],
        ),
        "float32",
    ),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import transformers

    from coordinator.tools.make_checkpoint import perturb_constant_parameters

    made: dict[str, CheckpointIndex] = {}

    def get(name: str) -> CheckpointIndex:
        if name not in made:
            cls, settings, dtype = CASES[name]
            config = getattr(transformers, cls)(**TINY, **settings)
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(
                config, dtype=getattr(torch, dtype)
            )
            perturb_constant_parameters(model, 0)
            root = tmp_path_factory.mktemp(name) / "ckpt"
            model.save_pretrained(root)
            made[name] = load_index(root)
        return made[name]

    return get


@pytest.fixture(autouse=True)
def fresh_verdicts(monkeypatch):
    """Each test checks anew (verdicts are cached per process)."""
    monkeypatch.setattr(family_check, "_verdicts", {})


@pytest.mark.parametrize("name", sorted(CASES))
def test_these_families_pass_the_check_and_load_as_transformers_does(checkpoints, name) -> None:
    """The check passes; then a real load (the planner's split over 3 stages, layers
    offloaded, same files, same dtype) gives transformers' logits bitwise, plain and
    left-padded, and each prompt's greedy `generate` tokens through the engine's batched
    steps (two prompts of different lengths in one batch), in KV slots of the bytes the
    planner counts."""
    index = checkpoints(name)
    if index.family in TESTED_FAMILIES:  # skipped at launch (CI compares it), never refused
        assert family_check._check(shrink_config(index.config), None) is None
    else:
        assert check_family(index.config) is True
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    padded, mask = ids[:, :7].clone(), torch.ones_like(ids[:, :7])
    padded[1, :3], mask[1, :3] = 0, 0
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    pipeline = Pipeline(index)
    try:
        logits = pipeline(ids)
        padded_logits = pipeline(padded, mask)
        prompts = [padded[0].tolist(), padded[1, 3:].tolist()]
        tokens = generate_each(pipeline, prompts, 6)
        # the KV slots the plan reserves are what the model's own cache writes filled
        kv_bytes = sum(worker.kv_cache_bytes() for worker in pipeline.workers)
    finally:
        pipeline.close()
    assert kv_bytes == sum(layer.kv_bytes(len(prompts), MAX_SEQ_LEN) for layer in index.layers)
    assert logits.dtype == getattr(torch, index.dtype)
    assert torch.equal(logits, reference(index, ids))
    assert torch.equal(
        padded_logits, reference(index, padded, attention_mask=mask, position_ids=positions)
    )
    assert tokens == [alone(index, prompt, 6) for prompt in prompts]


SPLIT_DIFFERS = "the pipeline split does not reproduce the whole model"
BATCHED_DIFFERS = "batched generation does not reproduce the model"


def _one_line_refusal(config: dict, family: str, what: str = SPLIT_DIFFERS) -> str:
    with pytest.raises(FamilyCheckError) as caught:
        check_family(config)
    message = str(caught.value)
    assert isinstance(caught.value, UnsupportedModelError)  # the CLI's user errors: exit 2
    assert "\n" not in message
    assert message.startswith(f"{family}: {what}")
    return message


def test_the_old_stand_ins_are_refused_naming_the_module(checkpoints, monkeypatch) -> None:
    """What used to fail inside a worker fails in the check, naming the module: a bare-tensor
    stand-in for Falcon's tuple-returning block, a position embedding stand-in without
    `position_ids`, and OPT's final norm taken for an embedding."""
    with monkeypatch.context() as patch:
        patch.setattr(worker.stage, "block_tuple_length", lambda block_class: 0)
        message = _one_line_refusal(checkpoints("falcon").config, "falcon")
    assert (
        "module transformer.h.1 / PassThrough returns a tensor where FalconDecoderLayer "
        "returns a tuple of 2; then ValueError: not enough values to unpack"
    ) in message

    def old_forward(self, ids):
        return torch.zeros(*ids.shape, self.embedding_dim, dtype=self.dtype)

    opt = checkpoints("opt").config
    with monkeypatch.context() as patch:
        patch.setattr(family_check, "_verdicts", {})
        patch.setattr(worker.stage.ZeroEmbedding, "forward", old_forward)
        message = _one_line_refusal(opt, "opt")
    assert "module model.decoder.embed_positions / ZeroEmbedding raised TypeError: " in message
    assert "old_forward() got an unexpected keyword argument 'position_ids'" in message
    with monkeypatch.context() as patch:
        patch.setattr(family_check, "_verdicts", {})
        patch.setattr("worker.layout._first_uses", lambda module: {})  # registration order
        message = _one_line_refusal(opt, "opt")
    assert "module model.decoder.final_layer_norm / LayerNorm: its input differs" in message


def test_a_wrong_batched_path_is_refused_naming_the_step(checkpoints, monkeypatch) -> None:
    """A family whose split is bitwise right through the per-request cache can still generate
    wrong tokens in batches: the check also runs the engine's batched steps (two prompts,
    left-padded, then decode steps), against each prompt alone, and names the step and row."""
    positions, mask = worker.batched.positions, worker.batch_view.BatchView.mask

    def one_too_far_when_decoding(rows) -> torch.Tensor:
        return positions(rows) + (rows.width == 1)

    with monkeypatch.context() as patch:  # OPT's learned positions are absolute: it shows
        patch.setattr(worker.batched, "positions", one_too_far_when_decoding)
        message = _one_line_refusal(checkpoints("opt").config, "opt", BATCHED_DIFFERS)
    assert "(decode step 1, row 0 (its 7-token prompt): logits differ by up to " in message
    assert message.endswith("; stages embed+layers.0 | layers.1 | head)")

    def shows_unwritten_keys(self, **kwargs) -> torch.Tensor:
        """Each row also sees the step's keys past its own sequence: the slot positions the
        shorter, left-padded row never wrote (zeros, or a freed sequence's keys)."""
        allowed = mask(self, **kwargs)
        past = torch.arange(self.kv_length) >= (self.starts + self.counts)[:, None, None, None]
        return allowed | past if allowed.dtype == torch.bool else allowed.masked_fill(past, 0)

    with monkeypatch.context() as patch:  # Falcon's rotary positions: a mask that leaks
        patch.setattr(family_check, "_verdicts", {})
        patch.setattr(worker.batch_view.BatchView, "mask", shows_unwritten_keys)
        message = _one_line_refusal(checkpoints("falcon").config, "falcon", BATCHED_DIFFERS)
    assert "(prefill, row 1 (its 4-token prompt): logits differ by up to " in message


def test_a_family_whose_masks_are_not_routed_is_refused(checkpoints, monkeypatch) -> None:
    """A family building its masks other than through the two functions `worker.stage` routes
    (here: OPT with routing undone) reaches the `BatchView`'s refusal; the check turns it into
    one line naming batched generation, the step and the module, not a traceback."""
    import transformers.masking_utils
    import transformers.models.opt.modeling_opt

    monkeypatch.setattr(worker.stage, "_route_masks", lambda base_class: None)
    # and undone where an earlier test's stages routed them already
    monkeypatch.setattr(
        transformers.models.opt.modeling_opt,
        "create_causal_mask",
        transformers.masking_utils.create_causal_mask,
    )
    message = _one_line_refusal(checkpoints("opt").config, "opt", BATCHED_DIFFERS)
    assert (
        "(prefill: stage 0, module model.decoder / OPTDecoder raised NotImplementedError: this "
        "model builds an attention mask that batched generation does not route"
    ) in message


def _drop_layer_1(monkeypatch) -> None:
    """Break the split on purpose: the stage holding decoder layer 1 passes it through."""
    build = worker.stage.Stage.__init__

    def broken(self, hf_config, layer_names) -> None:
        build(self, hf_config, layer_names)
        if "layers.1" in self.layer_names:
            self.model.get_submodule(self.layout.layers_path)[1] = worker.stage.PassThrough()

    monkeypatch.setattr(worker.stage.Stage, "__init__", broken)


def test_a_broken_pass_through_is_refused_and_nothing_starts(
    checkpoints, monkeypatch, capsys
) -> None:
    """A module dropped from the split: `plan`, `run` and `launch` all refuse in one line
    naming it (exit 2), before Ray or any worker starts."""
    import coordinator.runtime.launch as job_module
    from coordinator.config import JobConfig

    root = str(checkpoints("opt").root)
    _drop_layer_1(monkeypatch)
    message = _one_line_refusal(checkpoints("opt").config, "opt")
    assert "stage 1, module model.decoder.layers.1 / PassThrough: its output differs" in message

    def no_ray(config):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(job_module, "connect", no_ray)
    monkeypatch.setattr(family_check, "_verdicts", {})
    flags = ["--checkpoint", root, "--gpus", "2", "--gpu-memory", "1MiB"]
    assert main(["run", *flags]) == EXIT_ERROR
    assert main(["plan", *flags]) == EXIT_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0] == err[1] == f"error: {message}"
    with pytest.raises(FamilyCheckError, match=r"model\.decoder\.layers\.1 / PassThrough"):
        job_module.launch(JobConfig(checkpoint=root, gpus=2, gpu_memory_bytes=2**20))


def test_tested_families_skip_the_check_and_verdicts_are_cached(checkpoints, monkeypatch) -> None:
    calls = []
    check = family_check._check
    monkeypatch.setattr(family_check, "_check", lambda *a: calls.append(a) or check(*a))
    assert check_family({"model_type": "llama", "num_hidden_layers": 80}) is False
    assert calls == []  # nothing built: the check is skipped, not merely fast
    opt = checkpoints("opt").config
    assert check_family(opt) and check_family(dict(opt)) and len(calls) == 1  # launched twice
    assert check_family({**opt, "do_layer_norm_before": False}) and len(calls) == 2  # OPT-350M


def test_the_config_shrinks_keeping_its_structure() -> None:
    """2 layers of tiny widths, consistently: heads x head dim, grouped KV heads, a layer of
    each kind (Gemma 3: 5 sliding, 1 full), windows the check's input outruns; the rest kept."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "gemma3_text",
        num_hidden_layers=12,
        hidden_size=2560,
        intermediate_size=10240,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        sliding_window=1024,
        vocab_size=262208,
        tie_word_embeddings=True,
        eos_token_id=[1, 106],
        final_logit_softcapping=30.0,
        pad_token_id=262207,
    ).to_dict()
    small = shrink_config(config)
    assert small["num_hidden_layers"] == 2
    assert small["layer_types"] == ["sliding_attention", "full_attention"]
    assert (
        small["hidden_size"],
        small["num_attention_heads"],
        small["num_key_value_heads"],
        small["head_dim"],
        small["intermediate_size"],
    ) == (32, 4, 2, 8, 48)
    assert small["sliding_window"] == 4 and small["vocab_size"] == 128
    assert small["pad_token_id"] == 127 and small["eos_token_id"] == [1, 106]
    for key in (
        "tie_word_embeddings",
        "final_logit_softcapping",
        "rope_parameters",
        "query_pre_attn_scalar",
        "sliding_window_pattern",
    ):
        assert small.get(key) == config.get(key), key


def test_an_mla_config_shrinks_with_its_head_dims_coupled_and_passes() -> None:
    """DeepSeek-V3 as published (61 layers, 256 experts in 8 groups, MLA ranks 1536 / 512, a
    query/key head of 128 + 64 dims): the shrunk config keeps qk_head_dim the sum of its two
    parts, a dense first layer and a routed one, groups that divide the experts; the check
    passes, its batched steps included (before: refused, the slot pool shaped values like
    keys)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("deepseek_v3", n_group=8, topk_group=4).to_dict()
    small = shrink_config(config)
    assert small["qk_head_dim"] == small["qk_nope_head_dim"] + small["qk_rope_head_dim"] == 16
    assert small["first_k_dense_replace"] == 1 and small["num_hidden_layers"] == 2
    assert small["n_routed_experts"] % small["n_group"] == 0
    assert family_check._check(small, None) is None


@pytest.mark.parametrize(
    ("family", "settings", "kinds"),
    [
        # Bamba-9B's attention layers among 32 Mamba-2 ones; its mixer 128 heads x 64 = 2 x 4096
        ("bamba", dict(attn_layer_indices=[9, 18, 27], mamba_n_heads=128), "attn_layer_indices"),
        # Jamba: attention every 8th layer from the 5th, experts every other layer
        ("jamba", dict(), "attn_layer_period"),
        # LFM2: short convolutions, attention at some indices
        ("lfm2", dict(full_attn_idxs=[2, 5, 8], num_hidden_layers=16), "full_attn_idxs"),
        # Qwen3-Next: 3 gated delta-net layers to 1 full attention layer
        ("qwen3_next", dict(), "layer_types"),
    ],
)
def test_a_hybrid_shrinks_to_a_layer_of_each_kind_and_passes(family, settings, kinds) -> None:
    """The shrunk hybrid keeps a recurrent layer and an attention layer (else its recurrent
    state and its batched steps are never checked), Mamba-2 widths coupled (heads x head dim
    = expand x hidden); the check passes, recurrent states through the slot pools included."""
    from transformers import AutoConfig

    from worker.layout import hf_config_from_dict, measure_cache_writes

    small = shrink_config(AutoConfig.for_model(family, **settings).to_dict())
    writes = measure_cache_writes(hf_config_from_dict(small, dtype=torch.float32))
    assert writes.per_token and writes.per_sequence  # attention, and a recurrent state
    assert set(writes.per_token).isdisjoint(writes.per_sequence)  # in layers of their own
    if "mamba_n_heads" in small:
        assert small["mamba_n_heads"] * small["mamba_d_head"] == 2 * small["hidden_size"]
    assert small[kinds] is not None
    assert family_check._check(small, None) is None


def test_offloadctl_run_says_the_family_was_self_checked(checkpoints, monkeypatch, capsys) -> None:
    """`offloadctl run --check` on OPT: checked before launch, then its output says the family
    is untested and self-checked, and the logits match transformers. The job is the in-process
    pipeline (the Ray path runs the same workers; a Ray start would cost this test ~15 s)."""
    import coordinator.runtime.launch as job_module

    index = checkpoints("opt")

    class InProcessJob:
        def __init__(self, config) -> None:
            check_family(index.config)  # what launch() runs before Ray starts
            self.pipeline = Pipeline(index)
            self.index, self.plan = index, self.pipeline.plan
            self.workers = self.pipeline.workers
            self.load_reports = [worker.report() for worker in self.workers]
            self.session = type("Session", (), {"owned": True})()

        def forward(self, ids):
            return self.pipeline(ids)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.pipeline.close()

    monkeypatch.setattr(job_module, "launch", lambda config, **_: InProcessJob(config))
    argv = ["run", "--checkpoint", str(index.root), "--seq-len", "9", "--check"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert (
        "model: opt, float32, 4 blocks (a family not tested against transformers; "
        "self-checked before launch"
    ) in out
    assert "check: logits are bitwise equal" in out


def test_llama4_nope_temperature_past_its_floor_scale_is_refused_never_approximated() -> None:
    """Llama 4's NoPE layers scale queries by a temperature of the position, computed from the
    cache's one length: in a batch that is every row's, exact only while every position is
    below floor_scale - 1 (the scale is then 1). A step reaching further is refused."""
    import transformers

    from worker.batch_cache import KvPool
    from worker.layout import hf_config_from_dict
    from worker.stage import Stage
    from worker.steps import contiguous_tables

    settings = dict(CASES["llama4_text"][1], floor_scale=6)
    config = transformers.Llama4TextConfig(**TINY, **settings).to_dict()
    stage = Stage(hf_config_from_dict(config, dtype=torch.float32), ["embed", "layers.0"])
    assert stage.batched_positions == 5
    pool = KvPool([0], num_blocks=2, block_size=16, num_slots=2, device=torch.device("cpu"))
    ids = torch.zeros((2, 1), dtype=torch.long)
    with pytest.raises(ValueError, match=r"reaches position 5, .* max_seq_len <= 5"):
        stage(ids, cache=pool.view([0, 1], [2, 5], [1, 1], 1, contiguous_tables([0, 1], 16, 16)))


def test_a_config_the_shrink_breaks_is_checked_at_its_own_widths(checkpoints, monkeypatch) -> None:
    """A shrink problem is never reported as the model's: when the shrunk copy cannot be built
    (here a shrink that breaks heads x head dim = hidden), the check runs a layer of each kind
    at the config's own widths and passes; a copy too large for the driver is refused with the
    shrink's reason and its size."""
    import coordinator.small_config

    def wrong_widths(small, *args) -> None:
        small["hidden_size"] = 30  # not a multiple of the 4 heads

    monkeypatch.setattr(coordinator.small_config, "_shrink_widths", wrong_widths)
    config = checkpoints("opt").config
    assert check_family(config) is True
    monkeypatch.setattr(family_check, "_verdicts", {})
    monkeypatch.setattr(family_check, "WIDE_CHECK_BYTES", 1000)
    message = _one_line_refusal(config, "opt", "the pre-launch check of this untested family")
    assert "cannot build a 2-layer copy of its model" in message
    assert "at its own widths a copy of a layer of each kind takes 0.0 GiB" in message


@pytest.mark.parametrize(
    ("family", "continues"), [("qwen3_next", True), ("bamba", True), ("jamba", False)]
)
def test_prompts_are_chunked_only_where_the_familys_recurrence_continues_a_chunk(
    tmp_path, family, continues
) -> None:
    """Qwen3-Next's and Bamba's code continue their recurrent state over a second chunk as over
    the whole prompt; Jamba's does not (0.02 off): its index says so, and its engine feeds each
    prompt whole (`model_steps`)."""
    from coordinator.engine.engine import model_steps
    from coordinator.family_check import continues_chunks
    from coordinator.tools.make_checkpoint import make_checkpoint

    shape = family_shape(family)
    assert continues_chunks(shape.hf_config().to_dict()) is continues
    index = load_index(make_checkpoint(tmp_path / family, shape))
    assert model_steps(index) == {"uniform_steps": True, "whole_prompts": not continues}


def test_llama4s_experts_cross_whole_even_where_routing_is_asked(checkpoints) -> None:
    """Llama 4's experts module computes every expert on inputs its router scaled: it is not
    handed the routing. So the index gives its layers no routed experts, a plan asked to route
    them moves them whole and says why, and workers told to route anyway fetch them whole:
    transformers' logits either way. (The planner used to route them by default, and the load
    failed at its first step: "an experts module was called without integer routing
    indices".)"""
    index = checkpoints("llama4_text")
    moe = [layer.name for layer in index.layers if layer.unit_bytes("experts")]
    assert moe and not any(layer.experts for layer in index.layers)
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    planned = Pipeline(index, expert_fetch="routed")
    try:
        assert any(s.offloaded for s in planned.plan.stages)
        assert {s.expert_fetch for s in planned.plan.stages} == {"layer"}
        assert "no offloaded layer has experts that a step's routing picks" in (
            planned.plan.summary()
        )
        logits = planned(ids)
    finally:
        planned.close()
    names = [layer.name for layer in index.layers]
    told = Pipeline(index, [names[:2], names[2:]], tuple(moe), "experts", expert_fetch="routed")
    try:
        routed = told(ids)
        stats = [worker.offloader.stats() for worker in told.workers]
    finally:
        told.close()
    expected = reference(index, ids)
    assert torch.equal(logits, expected) and torch.equal(routed, expected)
    assert sum(s.copies for s in stats) and not any(s.expert_misses for s in stats)


@pytest.mark.parametrize("family", ["kimi_linear", "olmo_hybrid"])
def test_convolutions_published_in_parts_load_joined_as_transformers_does(tmp_path, family) -> None:
    """Kimi Linear and OLMo Hybrid keep each linear-attention layer's q, k and v short
    convolutions apart in their files; transformers joins them into one `conv1d` weight
    (`Concatenate` alone in its conversion mapping). The index reads each into its part of the
    joined weight, and two stages, each offloading its layer, give transformers' logits
    bitwise and its greedy tokens. (Their checkpoints were refused at indexing, "conversion
    ['Concatenate'] is not supported", though the family check passed their configs.)"""
    import transformers

    from coordinator.tools.make_checkpoint import perturb_constant_parameters

    small = shrink_config(transformers.AutoConfig.for_model(family).to_dict())
    small = {k: v for k, v in small.items() if k not in ("model_type", "transformers_version")}
    small.update(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config = transformers.AutoConfig.for_model(family, **small)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    perturb_constant_parameters(model, 0)
    model.save_pretrained(tmp_path / family)
    index = load_index(tmp_path / family)
    joined = [
        t for layer in index.layers for t in layer.tensors if t.target.endswith(".conv1d.weight")
    ]
    parts = {t.name.rpartition(".")[0].rpartition(".")[2] for t in joined}
    assert parts == {"q_conv1d", "k_conv1d", "v_conv1d"}
    assert all(t.view[0][0] == "narrow" for t in joined)
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    names = [layer.name for layer in index.layers]  # embed, both decoder layers, head
    pipeline = Pipeline(index, [names[:2], names[2:]], offloaded=("layers.0", "layers.1"))
    try:
        logits = pipeline(ids)
        prompts = [ids[0, :7].tolist(), ids[1, :4].tolist()]
        tokens = generate_each(pipeline, prompts, 6)
    finally:
        pipeline.close()
    assert torch.equal(logits, reference(index, ids))
    assert tokens == [alone(index, prompt, 6) for prompt in prompts]
