"""Per-expert checkpoint tensors, as `save_pretrained` writes MoE models, fill the fused expert
parameters of the transformers 5 modules exactly as `from_pretrained`'s own conversion does, each
straight into its place; and every layer counts its experts' bytes."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch
from safetensors import safe_open

from coordinator.planning.checkpoint import load_index, read_header
from coordinator.planning.weight_map import WeightMapError, map_tensors
from coordinator.tools.make_checkpoint import CheckpointShape, make_checkpoint
from offload.errors import CheckpointError
from worker.layout import build_meta_model, hf_config_from_dict
from worker.loader import TensorReader
from worker.spec import apply_view

MOE = ("mixtral", "qwen2_moe", "qwen3_moe")


@pytest.mark.parametrize("arch", MOE)
def test_expert_tensors_fill_the_fused_parameters_as_transformers_fuses_them(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    shape = CheckpointShape(
        arch=arch,
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=48,
        vocab_size=64,
        num_experts=4,
        max_shard_bytes=50_000,
    )
    root = make_checkpoint(tmp_path / arch, shape)
    index = load_index(root)
    model = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32)
    expected = model.state_dict()

    # The files hold one tensor per expert, as the Hub does.
    names = [t.name for layer in index.layers for t in layer.tensors]
    assert sum(bool(re.search(r"\.experts\.3\.", n)) for n in names) == 2 * 3  # 2 layers x 3 mats
    fused = {t.target for layer in index.layers for t in layer.tensors if t.view}
    assert fused == {
        f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")
    }

    # Rebuild every parameter from the index alone: each tensor's bytes into its view. NaN
    # first, so a part no tensor fills shows.
    built = {name: torch.full_like(t, float("nan")) for name, t in expected.items()}
    with TensorReader(root) as reader:
        for layer in index.layers:
            for t in layer.tensors:
                view = apply_view(built[t.target], t.view)
                assert view.is_contiguous(), t.name  # read straight into place, no staging
                reader.read_into(t, view)
    for name, value in expected.items():
        assert torch.equal(built[name], value), name

    # Plan and telemetry count expert bytes: a layer is all of its block's parameters.
    for i, block in enumerate(model.model.layers):
        layer = next(x for x in index.layers if x.name == f"layers.{i}")
        assert layer.nbytes == sum(p.numel() * p.element_size() for p in block.parameters())


# What `map_tensors` promises its callers (the index, the loader, the planner's byte counts),
# checked on checkpoints written to disk and read back by their headers alone.

PARTITIONED = ("llama", "qwen2", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


def write(tmp_path, arch: str, **changes):
    """A tiny checkpoint of `arch` on disk: (its directory, config.json, every file tensor's
    header entry, as `read_header` gives it)."""
    fields = dict(
        arch=arch,
        num_layers=2,
        hidden_size=16,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=8,
        vocab_size=32,
        num_experts=4,
        max_shard_bytes=6_000,
        tokenizer=False,
    )
    root = make_checkpoint(tmp_path / arch, CheckpointShape(**{**fields, **changes}))
    tensors = {}
    for path in sorted(root.glob("*.safetensors")):
        tensors.update(read_header(path))
    return root, json.loads((root / "config.json").read_text()), tensors


def meta_model(config: dict, dtype: torch.dtype = torch.float32):
    return build_meta_model(hf_config_from_dict(config, dtype=dtype))


@pytest.mark.parametrize("arch", PARTITIONED)
def test_every_parameter_is_filled_exactly_once_and_every_file_tensor_is_placed(tmp_path, arch):
    """Each parameter and persistent buffer is covered by its slices' views element for
    element, none twice and none missed (counted on a real tensor of its shape); every tensor
    of the files is placed (or listed as ignored), none invented; the bytes placed are the
    files' bytes (as safetensors reads them), a tied head's once more; each slice says the
    dtype the model keeps it in (bfloat16 files into a float32 model) and whether it fills a
    buffer."""
    tied = arch == "qwen2"
    root, config, tensors = write(tmp_path, arch, dtype="bfloat16", tie_embeddings=tied)
    model = meta_model(config)
    placed, ignored = map_tensors(model, tensors)

    expected = model.state_dict(keep_vars=True)
    counts = {name: torch.zeros(t.shape, dtype=torch.int32) for name, t in expected.items()}
    for t in placed:
        param = expected[t.target]
        apply_view(counts[t.target], t.view).add_(1)
        assert t.target_dtype == str(param.dtype).removeprefix("torch."), t.name
        assert t.buffer is not isinstance(param, torch.nn.Parameter), t.name
        assert t.nbytes == math.prod(t.shape) * 2, t.name  # bfloat16 in the file
    for name, count in counts.items():
        assert count.min() == count.max() == 1, f"{name}: elements filled {count.unique()}"

    names = {t.name for t in placed}
    assert names | set(ignored) == tensors.keys() and not names & set(ignored)
    on_disk = 0
    for path in root.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                tensor = f.get_tensor(key)
                on_disk += tensor.numel() * tensor.element_size()
    embed = next(t for t in placed if t.target == "model.embed_tokens.weight")
    twice = embed.nbytes if tied else 0
    assert sum(t.nbytes for t in placed) == on_disk + twice
    sources = [t.name for t in placed]
    assert len(sources) == len(names) + (1 if tied else 0), "a file tensor placed twice"
    if tied:  # the head reads the embedding's bytes into its own weight
        head = [t for t in placed if t.target == "lm_head.weight"]
        assert [t.name for t in head] == ["model.embed_tokens.weight"]


def test_experts_past_the_tenth_fill_their_own_places(tmp_path):
    """Expert e fills place e of the fused parameters whatever its number's text sorts like
    (experts.10 after experts.9, not after experts.1), and the header's order does not
    matter: the values read into the views are what from_pretrained makes."""
    from transformers import AutoModelForCausalLM

    root, config, tensors = write(tmp_path, "qwen3_moe", num_layers=1, num_experts=12)
    model = meta_model(config)
    keys = sorted(tensors, reverse=True)  # a header in another order: the same mapping
    placed, _ = map_tensors(model, {k: tensors[k] for k in keys})
    again, _ = map_tensors(model, tensors)
    assert sorted(map(repr, placed)) == sorted(map(repr, again))

    for t in placed:
        match = re.search(r"\.experts\.(\d+)\.", t.name)
        if match:
            assert t.view[-1] == ("select", 0, int(match.group(1))), (t.name, t.view)
    truth = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32).state_dict()
    built = {name: torch.full_like(value, float("nan")) for name, value in truth.items()}
    stored = {}
    for path in root.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            stored.update({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118
    for t in placed:
        apply_view(built[t.target], t.view).copy_(stored[t.name])
    for name, value in truth.items():
        assert torch.equal(built[name], value), name


def test_a_missing_expert_is_refused_naming_the_parameters_it_leaves_unfilled(tmp_path):
    """Without expert 2's tensors the experts after it would slide into its place: refused,
    naming the fused parameters left short."""
    _, config, tensors = write(tmp_path, "mixtral", num_layers=1)
    model = meta_model(config)
    kept = {k: v for k, v in tensors.items() if ".experts.2." not in k}
    assert len(kept) == len(tensors) - 3
    with pytest.raises(WeightMapError, match="lacks 2 weights") as info:
        map_tensors(model, kept)
    assert isinstance(info.value, CheckpointError)
    for param in (
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
    ):
        assert param in str(info.value)


def test_an_expert_of_the_wrong_shape_is_refused_naming_it_its_file_and_the_shape_wanted(
    tmp_path,
):
    _, config, tensors = write(tmp_path, "qwen2_moe", num_layers=1)
    model = meta_model(config)
    name = "model.layers.0.mlp.experts.1.up_proj.weight"
    wrong = dict(tensors)
    wrong[name] = dataclasses.replace(tensors[name], shape=(9, 16))
    with pytest.raises(WeightMapError) as info:
        map_tensors(model, wrong)
    message = str(info.value)
    assert message.startswith(f"{tensors[name].file}: tensor {name!r} has shape [9, 16]")
    assert "config.json implies [8, 16] for 'model.layers.0.mlp.experts.gate_up_proj'" in message


def test_an_expert_past_the_configs_count_is_refused_naming_it(tmp_path):
    _, config, tensors = write(tmp_path, "qwen3_moe", num_layers=1)
    model = meta_model(config)
    extra = dict(tensors)
    for mat in ("gate_proj", "up_proj", "down_proj"):
        name = f"model.layers.0.mlp.experts.4.{mat}.weight"
        source = tensors[f"model.layers.0.mlp.experts.0.{mat}.weight"]
        extra[name] = dataclasses.replace(source, name=name)
    try:
        map_tensors(model, extra)
    except WeightMapError as exc:
        assert "experts.4." in str(exc) and source.file in str(exc)
    except Exception as exc:
        raise AssertionError(f"refused with {type(exc).__name__}: {exc}") from exc
    else:
        raise AssertionError("an expert the model does not have was placed")


def joined_checkpoint(tmp_path):
    """OLMo Hybrid's default config shrunk as the family check shrinks it, saved by
    transformers: its linear-attention q, k and v convolutions stored apart. (its directory,
    config.json, every file tensor's header entry)"""
    from transformers import AutoConfig, AutoModelForCausalLM

    from coordinator.small_config import shrink_config

    small = shrink_config(AutoConfig.for_model("olmo_hybrid").to_dict())
    small = {k: v for k, v in small.items() if k not in ("model_type", "transformers_version")}
    small.update(vocab_size=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("olmo_hybrid", **small))
    root = tmp_path / "olmo_hybrid"
    model.save_pretrained(root)
    tensors = {}
    for path in sorted(root.glob("*.safetensors")):
        tensors.update(read_header(path))
    return root, json.loads((root / "config.json").read_text()), tensors


def test_parts_joined_by_transformers_fill_their_places_in_the_joined_weight(tmp_path):
    """q, k and v convolutions (`Concatenate` alone in transformers' conversion) each fill
    their part of the joined `conv1d` weight, in that order along dim 0: the values read into
    the views are what from_pretrained makes."""
    from transformers import AutoModelForCausalLM

    root, config, tensors = joined_checkpoint(tmp_path)
    placed, _ = map_tensors(meta_model(config), tensors)
    parts = [t for t in placed if t.target.endswith("conv1d.weight")]
    assert {t.name.split(".")[-2] for t in parts} == {"q_conv1d", "k_conv1d", "v_conv1d"}
    truth = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32).state_dict()
    built = {name: torch.full_like(value, float("nan")) for name, value in truth.items()}
    with safe_open(next(root.glob("*.safetensors")), "pt") as f:
        stored = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    for t in placed:
        apply_view(built[t.target], t.view).copy_(stored[t.name])
    for t in parts:
        assert torch.equal(built[t.target], truth[t.target]), t.target


def test_a_missing_or_oversized_part_of_a_joined_weight_is_refused_naming_it(tmp_path):
    _, config, tensors = joined_checkpoint(tmp_path)
    model = meta_model(config)
    k_conv = next(name for name in tensors if name.endswith("k_conv1d.weight"))
    joined = k_conv.replace("k_conv1d", "conv1d")
    without = {name: t for name, t in tensors.items() if name != k_conv}
    with pytest.raises(WeightMapError, match="lacks 1 weights") as info:
        map_tensors(model, without)
    assert joined in str(info.value)
    wide = dict(tensors)
    rows, *rest = tensors[k_conv].shape
    wide[k_conv] = dataclasses.replace(tensors[k_conv], shape=(rows * 3, *rest))
    with pytest.raises(WeightMapError) as info:
        map_tensors(model, wide)
    assert str(info.value).startswith(f"{tensors[k_conv].file}: tensor {k_conv!r}")
    assert joined in str(info.value)
