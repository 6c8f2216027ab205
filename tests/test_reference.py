"""The reference's kept models (coordinator.tools.reference.keep): a later call on the same
files reuses the model `from_pretrained` loaded; a checkpoint rewritten since is loaded again,
and nothing is kept unless asked."""

from __future__ import annotations

import torch
from helpers import tiny_shape
from transformers import AutoModelForCausalLM

from coordinator.tools import reference
from coordinator.tools.make_checkpoint import make_checkpoint
from coordinator.tools.reference import reference_generate, reference_logits


def test_a_kept_model_is_reused_until_its_files_change(tmp_path, monkeypatch) -> None:
    loads = []
    real = AutoModelForCausalLM.from_pretrained

    def counted(*args, **kwargs):
        loads.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", counted)
    root = make_checkpoint(tmp_path / "ckpt", tiny_shape(2))
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(0))
    previous = reference.keep(0)  # nothing kept: a load per call
    try:
        first = reference_logits(str(root), ids)
        assert torch.equal(reference_logits(str(root), ids), first) and len(loads) == 2
        reference.keep(2)
        reference_logits(str(root), ids)
        again = reference_logits(str(root), ids)
        out = reference_generate(str(root), ids, max_new_tokens=3, do_sample=False)
        assert torch.equal(again, first) and len(loads) == 3  # kept after the first
        assert out.shape == (1, 8)
        make_checkpoint(root, tiny_shape(2, seed=7), force=True)  # same config, new weights
        rewritten = reference_logits(str(root), ids)
        assert len(loads) == 4 and not torch.equal(rewritten, first)
        fresh = real(str(root), dtype=torch.float32)
        with torch.no_grad():
            assert torch.equal(fresh(ids).logits, rewritten)
    finally:
        reference.keep(previous)
