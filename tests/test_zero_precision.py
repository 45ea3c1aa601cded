"""Mixed precision: a bf16 model with fp32 master shards matches one process doing the same."""

from __future__ import annotations

import pytest
import torch

from tests import zero_cases

STEPS, LR = 6, 1e-3


def assemble(per_rank) -> dict[str, torch.Tensor]:
    """Full fp32 masters from every rank's shards (through the layouts' pieces)."""
    full: dict[str, torch.Tensor] = {}
    for rank, result in enumerate(per_rank):
        for names, shapes, layout, master in result["groups"]:
            flats = [full.setdefault(n, torch.full(s, float("nan"))).view(-1)
                     for n, s in zip(names, shapes)]
            for pc in layout.pieces[rank]:
                flats[pc.param][pc.param_offset:pc.param_offset + pc.length] = (
                    master[pc.shard_offset:pc.shard_offset + pc.length])
    return full


@pytest.mark.parametrize(("stage", "reduce_dtype"),
                         [(1, None), (2, None), (3, None), (2, "float32"), (3, "float32")])
def test_bf16_model_with_fp32_master_shards(pools, stage, reduce_dtype):
    """Updates of 1e-3 are below bf16's resolution for most weights: without fp32 masters
    they would round away (errors ~1e-3); with them the result follows the reference."""
    per_rank = pools(2).run(zero_cases.run_bf16, stage, STEPS, LR, reduce_dtype)
    masters = assemble(per_rank)
    expected = zero_cases.reference_bf16(STEPS, LR)
    initial = {n: p.detach().float() for n, p in zero_cases.make_net(torch.bfloat16)
               .named_parameters()}
    for result in per_rank:
        assert result["master_dtypes"] == {"torch.float32"}
        for name, param in result["params"].items():
            assert param.dtype == torch.bfloat16
            torch.testing.assert_close(param, masters[name].to(torch.bfloat16), rtol=0, atol=0)
    for name, master in masters.items():
        assert (expected[name] - initial[name]).abs().max() > 20 * 1e-4  # training moved it
        torch.testing.assert_close(master, expected[name], rtol=0, atol=1e-4)
    if reduce_dtype is not None:
        assert per_rank[0]["grad_dtypes"] == {f"torch.{reduce_dtype}"}
