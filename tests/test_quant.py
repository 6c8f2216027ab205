"""8-bit offloaded weights (`offload.quant`): block formats, quantizing and dequantizing (against
transformers' own FP8 dequantization), and the prefetch offloader keeping layers in 8 bits in
host memory and dequantizing them into their slots after each copy."""

from __future__ import annotations

import pytest
import torch
from helpers import run_stack
from torch import nn

from offload import OffloadConfig, PrefetchOffloader, create_offloader
from offload import quant as quant_module
from offload.errors import OffloadError
from offload.probe import NodeProbe
from offload.quant import BlockFormat, QuantizedTensor, dequantize_into, quantized

FP8 = BlockFormat(torch.float8_e4m3fn, (128, 128))
INT8_ROWS = BlockFormat(torch.int8, (1, 128))
FP8_ROWS = BlockFormat(torch.float8_e4m3fn, (1, 128))


def weights(*shape: int, seed: int = 0, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g)
    w[..., :7] *= 30  # outliers in some blocks, as real weights have
    return w.to(dtype)


def test_fp8_dequantization_is_bitwise_transformers_own() -> None:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    w = weights(256, 384)
    q = quantized(w, FP8)
    ours = q.dequantized(torch.bfloat16)
    theirs = Fp8Dequantize(None)._dequantize_one(q.q, q.scales, torch.bfloat16)
    assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


@pytest.mark.parametrize("fmt", [FP8, INT8_ROWS, FP8_ROWS], ids=str)
def test_quantization_error_is_bounded_by_each_block_scale(fmt: BlockFormat) -> None:
    w = weights(2, 256, 384).float()
    q = quantized(w, fmt)
    back = q.dequantized(torch.float32)
    scale = q.scales.repeat_interleave(fmt.block[0], -2).repeat_interleave(fmt.block[1], -1)
    err = (back - w).abs()
    if fmt.dtype == torch.int8:  # round to nearest step: half a step at most
        assert torch.all(err <= scale * 0.5 + 1e-6)
    else:  # e4m3: 3 mantissa bits, relative error <= 2^-4 above the subnormals
        assert torch.all(err <= w.abs() * 2**-4 + scale * 2**-9 + 1e-6)
    # every block's largest entry maps to the dtype's largest value
    assert q.scales.numel() == 2 * (256 // fmt.block[0]) * (384 // fmt.block[1])
    assert fmt.stored_bytes((2, 256, 384)) == q.nbytes <= 0.52 * w.numel() * 2


def test_chunked_work_is_bitwise_the_whole(monkeypatch) -> None:
    w = weights(512, 256)
    whole_q = quantized(w, INT8_ROWS)
    whole = whole_q.dequantized(torch.bfloat16)
    monkeypatch.setattr(quant_module, "CHUNK_ELEMENTS", 1000)  # many chunks of whole blocks
    chunked_q = quantized(w, INT8_ROWS)
    assert torch.equal(chunked_q.q, whole_q.q) and torch.equal(chunked_q.scales, whole_q.scales)
    out = torch.empty_like(whole)
    dequantize_into(out, chunked_q)
    assert torch.equal(out, whole)


def test_views_take_whole_blocks_only() -> None:
    q = quantized(weights(4, 256, 256), FP8)
    part = q.select(0, 2).narrow(0, 128, 128)
    assert torch.equal(part.dequantized(torch.bfloat16), q.dequantized(torch.bfloat16)[2, 128:])
    new = weights(128, 256, seed=5)
    part.copy_(new)  # a part written through the view lands in place
    alone = quantized(new, FP8)
    assert torch.equal(q.q[2, 128:].view(torch.uint8), alone.q.view(torch.uint8))
    assert torch.equal(q.scales[2, 1:], alone.scales)
    with pytest.raises(ValueError, match="not whole"):
        q.narrow(1, 64, 128)
    with pytest.raises(ValueError, match="blocked"):
        q.select(-1, 0)
    # the last block of a dim may be partial: the grid is ceil(shape / block)
    assert FP8.scale_shape((4, 100, 257)) == (4, 1, 3)
    with pytest.raises(ValueError, match="no two dims"):
        FP8.scale_shape((256,))
    with pytest.raises(ValueError, match="cannot copy"):
        q.copy_(quantized(weights(4, 256, 256), INT8_ROWS))
    with pytest.raises(ValueError, match="dtype"):
        BlockFormat(torch.bfloat16, (1, 128))


def linear_stack(num_layers: int, hidden: int = 256, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    layers = []
    for _ in range(num_layers):
        block = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.LayerNorm(hidden))
        block = block.to(torch.bfloat16).eval()
        layers.append(block)
    return layers


def fake_quantized(layers: list[nn.Module], offloaded: tuple[int, ...], fmt) -> list[nn.Module]:
    """The reference: the same layers with the offloaded ones' matrices quantized and back."""
    import copy

    out = copy.deepcopy(layers)
    with torch.no_grad():
        for i in offloaded:
            linear = out[i][0]
            linear.weight.copy_(quantized(linear.weight, fmt).dequantized(torch.bfloat16))
    return out


@pytest.mark.parametrize(
    ("num_layers", "offloaded", "step"),
    [(5, (0, 1, 2, 3, 4), 2), (6, (1, 3, 5), 1), (7, (0, 2, 3, 5, 6), 3), (4, (1, 2), 0)],
)
@pytest.mark.parametrize("fmt", [FP8, INT8_ROWS], ids=str)
def test_prefetch_keeps_layers_8bit_and_dequantizes_them_into_slots(
    num_layers: int, offloaded: tuple[int, ...], step: int, fmt: BlockFormat
) -> None:
    layers = linear_stack(num_layers)
    reference = fake_quantized(layers, offloaded, fmt)
    x = torch.randn(3, 256).to(torch.bfloat16)
    expected = run_stack(reference, x)
    formats = {f"{i}.0.weight": fmt for i in offloaded}
    config = OffloadConfig(backend="prefetch", layers=offloaded, prefetch_step=step)
    offloader = PrefetchOffloader(config, device="cpu", formats=formats)
    wide = sum(p.numel() * 2 for i in offloaded for p in layers[i].parameters())
    offloader.wrap_modules(layers)
    offloader.post_init()
    try:
        assert isinstance(offloader.host_tensors()[f"{offloaded[0]}.0.weight"], QuantizedTensor)
        for _ in range(3):  # every slot reused across forwards
            assert torch.equal(run_stack(layers, x), expected)
        before = offloader.stats()
        assert torch.equal(run_stack(layers, x), expected)
        offloader.synchronize()
        stats = offloader.stats()
        assert stats.offloaded_bytes <= 0.55 * wide  # 8-bit matrices, scales, wide norms
        # a forward brings in once, as stored, every offloaded layer that shares its slot
        host = offloader.host_tensors()
        shared = [
            j for j in range(len(offloaded)) if not (len(offloaded) - step <= j < max(step, 1))
        ]
        expected_bytes = sum(
            host[f"{offloaded[j]}.{name}"].nbytes
            for j in shared
            for name, _ in layers[0].named_parameters()
        )
        assert stats.copied_bytes - before.copied_bytes == expected_bytes
        assert stats.dequant_s > 0
    finally:
        offloader.detach()
    # detached: the dequantized weights are back on the device, the forward unchanged
    assert torch.equal(run_stack(layers, x), expected)


def test_8bit_weights_cross_in_pieces_through_a_small_staging_buffer(monkeypatch) -> None:
    """A weight larger than the staging buffer crosses in pieces of whole block rows, each
    dequantized into its rows of the slot: the device holds one piece beside the slots."""
    monkeypatch.setattr(quant_module, "STAGING_BYTES", 5000)  # 256-wide rows: 19 per piece
    layers = linear_stack(4)
    reference = fake_quantized(layers, (1, 2, 3), INT8_ROWS)
    x = torch.randn(3, 256).to(torch.bfloat16)
    formats = {f"{i}.0.weight": INT8_ROWS for i in (1, 2, 3)}
    offloader = PrefetchOffloader(
        OffloadConfig(backend="prefetch", layers=(1, 2, 3), prefetch_step=2),
        device="cpu",
        formats=formats,
    )
    offloader.wrap_modules(layers)
    offloader.post_init()
    try:
        for _ in range(2):
            assert torch.equal(run_stack(layers, x), run_stack(reference, x))
        stats = offloader.stats()
        staging = INT8_ROWS.staging_bytes((256, 256))
        assert staging < 5000 + 512
        assert stats.buffer_bytes == 2 * offloader._slots[0].numel() + staging
    finally:
        offloader.detach()


def test_prefetch_fills_meta_parameters_through_quantized_host_tensors() -> None:
    layers = linear_stack(3)
    source = [dict(layer.state_dict()) for layer in layers]
    reference = fake_quantized(layers, (1, 2), INT8_ROWS)
    x = torch.randn(2, 256).to(torch.bfloat16)
    for layer in layers[1:]:
        layer.to("meta")
    formats = {"1.0.weight": INT8_ROWS, "2.0.weight": INT8_ROWS}
    offloader = PrefetchOffloader(
        OffloadConfig(backend="prefetch", layers=(1, 2)), device="cpu", formats=formats
    )
    offloader.wrap_modules(layers)
    for key, host in offloader.host_tensors().items():  # what a loader does
        index, name = key.split(".", 1)
        host.copy_(source[int(index)][name])
    offloader.post_init()
    try:
        assert torch.equal(run_stack(layers, x), run_stack(reference, x))
    finally:
        offloader.detach()


def test_formats_need_the_prefetch_backend_and_fitting_weights() -> None:
    probe = NodeProbe(cuda_available=False)
    config = OffloadConfig(backend="uva", layers=(0,))
    with pytest.raises(OffloadError, match="prefetch backend"):
        create_offloader(config, device="cpu", probe=probe, formats={"0.0.weight": FP8})
    layers = linear_stack(2, hidden=200)
    offloader = PrefetchOffloader(
        OffloadConfig(backend="prefetch", layers=(0,)),
        device="cpu",
        formats={"0.0.bias": INT8_ROWS},  # one dimension: no blocks
    )
    with pytest.raises(ValueError, match="cannot be kept as int8"):
        offloader.wrap_modules(layers)
    offloader = PrefetchOffloader(
        OffloadConfig(backend="prefetch", layers=(0,)),
        device="cpu",
        formats={"1.0.weight": INT8_ROWS},
    )
    with pytest.raises(ValueError, match="not offloaded"):
        offloader.wrap_modules(linear_stack(2))
