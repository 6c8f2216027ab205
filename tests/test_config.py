"""OffloadConfig: layer selection and every invalid field."""

from __future__ import annotations

import pytest

from offload import OffloadConfig


@pytest.mark.parametrize(
    ("kwargs", "num_layers", "expected"),
    [
        (dict(layers=(3, 0)), 4, (0, 3)),
        (dict(group_size=2, num_in_group=1), 5, (1, 3)),
        (dict(group_size=3, num_in_group=2), 7, (1, 2, 4, 5)),
        (dict(group_size=1, num_in_group=1), 3, (0, 1, 2)),
        (dict(group_size=4, num_in_group=1), 3, ()),
        (dict(backend="none"), 3, ()),
    ],
)
def test_select_layers(kwargs: dict, num_layers: int, expected: tuple) -> None:
    assert OffloadConfig(**kwargs).select_layers(num_layers) == expected


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(backend="gpu", layers=(0,)), "backend"),
        (dict(layers=(0,), prefetch_step=-1), "prefetch_step"),
        (dict(layers=(0,), prefetch_step=65), "prefetch_step"),
        (dict(layers=(0,), param_filter="(unclosed"), "param_filter"),
        (dict(layers=(0,), group_size=2, num_in_group=1), "either"),
        (dict(), "choose the layers"),
        (dict(layers=()), "layers=()"),
        (dict(layers=[0, 1]), "tuple"),
        (dict(layers=(0, -1)), "invalid indices"),
        (dict(layers=(1, 1)), "duplicates"),
        (dict(group_size=0, num_in_group=1), "group_size"),
        (dict(group_size=2, num_in_group=3), "num_in_group"),
        (dict(group_size=2, num_in_group=0), "num_in_group"),
    ],
)
def test_invalid_config_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace(")", r"\)")):
        OffloadConfig(**kwargs)


def test_out_of_range_layer_is_reported_against_the_module_count() -> None:
    with pytest.raises(ValueError, match=r"indices \[5\].*only 3 modules"):
        OffloadConfig(layers=(0, 5)).select_layers(3)


def test_config_is_frozen() -> None:
    config = OffloadConfig(layers=(0,))
    with pytest.raises(AttributeError):
        config.prefetch_step = 3  # type: ignore[misc]


def test_param_filter() -> None:
    config = OffloadConfig(layers=(0,), param_filter=r"mlp\.")
    assert config.matches_param("mlp.up_proj.weight")
    assert not config.matches_param("self_attn.q_proj.weight")
    assert OffloadConfig(layers=(0,)).matches_param("anything")
