"""``fastsync.host.lora_merge``: a PEFT LoRA policy's merged weights, each trainer rank its own
slice, on real PEFT models (no engine, no DeepSpeed, no process group: adapters whole, as below
ZeRO-3; the ZeRO-3 base partitions are the ``ds_*`` attributes DeepSpeed sets, laid on by hand).
The slices of all ranks, put together, must be PEFT's own ``merge_and_unload()`` bit for bit;
settings whose merge is something else are refused by name. The merged sync through real
OpenRLHF, DeepSpeed ZeRO-3 and vLLM runs in tests/matrix/test_matrix_openrlhf.py (``lora``)."""

from __future__ import annotations

import copy

import pytest
import torch

peft = pytest.importorskip("peft")

from fastsync.errors import ConfigError  # noqa: E402
from fastsync.host.lora_merge import MergedLoraSources, merged_slice  # noqa: E402

TARGETS = ["q", "o", "up"]


class _Tiny(torch.nn.Module):
    """Awkward sizes: no row count or element count divides the world sizes evenly."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = torch.nn.Linear(13, 11, bias=True), torch.nn.Linear(11, 13, bias=False)
        self.up, self.down = torch.nn.Linear(13, 29, bias=False), torch.nn.Linear(29, 13, bias=False)
        self.emb = torch.nn.Embedding(17, 13)

    def forward(self, x):  # noqa: D401 - never run
        return self.down(self.up(self.o(self.q(x))))


def _peft(dtype=torch.float32, **config):
    torch.manual_seed(0)
    base = _Tiny().to(dtype)
    pm = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                   init_lora_weights=False, **config))
    with torch.no_grad():  # nonzero B everywhere (as after a training step)
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    return pm


def _want(pm) -> dict:
    return {n: t.clone() for n, t in copy.deepcopy(pm).merge_and_unload().state_dict().items()}


def _gathered(pm, world_size: int, zero3_bases: bool = False) -> dict:
    """Each parameter whole again from every rank's sources (merged slices, or its own memory)."""
    ranks = []
    for r in range(world_size):
        if zero3_bases:  # ZeRO-3's partition of every targeted base weight, as DeepSpeed lays it out
            for m in pm.get_base_model().modules():
                if hasattr(m, "base_layer"):
                    w = m.base_layer.weight
                    part = -(-w.numel() // world_size)
                    flat = torch.zeros(part * world_size, dtype=w.dtype)
                    flat[:w.numel()] = w.detach().reshape(-1)
                    w.ds_tensor, w.ds_numel, w.ds_shape = flat[r * part:(r + 1) * part].clone(), w.numel(), w.shape
        merged = MergedLoraSources(pm, rank=r, world_size=world_size)
        layout, sources = merged.plan()
        merged.refresh()
        ranks.append((layout, {n: t.clone() for n, t in sources.items()}))
    out = {}
    for name, spec in ranks[0][0].params.items():
        full = torch.full(spec.shape, float("nan"), dtype=torch.float64)
        for r, (layout, sources) in enumerate(ranks):
            for sh in layout.shards_on(r).get(name, []):
                idx = tuple(slice(a, b) for a, b in sh.box)
                n = full[idx].numel()
                src = sources[name].reshape(-1)[sh.local_offset:sh.local_offset + n]  # a box is a run of the flat source
                full[idx] = src.reshape(full[idx].shape).double()
        out[name] = full
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slices_of_all_ranks_are_peft_merge_and_unload_bit_for_bit(world_size, dtype):
    pm = _peft(dtype)
    want = _want(pm)
    got = _gathered(pm, world_size)
    assert set(got) == set(want)  # the base names, no adapter matrices
    for n, t in want.items():
        assert torch.equal(got[n].to(dtype), t), n
    assert not torch.equal(want["q.weight"], pm.get_base_model().q.base_layer.weight), "the adapters were zero"


def test_zero3_partitions_of_the_base_merge_in_place_of_the_partition():
    pm = _peft(use_rslora=True, rank_pattern={"up": 2}, alpha_pattern={"o": 5})  # per-module scaling, rsLoRA
    want = _want(pm)
    got = _gathered(pm, 3, zero3_bases=True)
    for n, t in want.items():
        assert torch.equal(got[n].float(), t), n


def test_merged_slice_touches_only_the_rows_it_needs():
    torch.manual_seed(1)
    w, a, b = torch.randn(5, 7), torch.randn(3, 7), torch.randn(5, 3)
    want = (w + (b @ a) * 0.5).reshape(-1)
    out = torch.zeros(12)
    merged_slice(w.reshape(-1)[9:20], 9, (5, 7), a, b, 0.5, out)
    assert torch.allclose(out[:11], want[9:20], rtol=0, atol=1e-6) and torch.equal(out[11:], torch.zeros(1))


@pytest.mark.parametrize("config, named", [
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["down"]}, "modules_to_save"),
    ({"lora_bias": True}, "lora_bias"),
])
def test_settings_with_another_merge_are_refused_by_name(config, named):
    with pytest.raises(ConfigError, match=rf"LoraConfig.{named}="):
        MergedLoraSources(_peft(**config), rank=0, world_size=2)


@pytest.mark.parametrize("key, value", [("layer_replication", [(0, 1)]), ("target_parameters", ["up.weight"]),
                                        ("alora_invocation_tokens", [5])])
def test_settings_peft_builds_only_on_other_models_are_refused_by_name(key, value):
    pm = _peft()
    setattr(pm.peft_config["default"], key, value)  # as a model that has them would carry it
    with pytest.raises(ConfigError, match=rf"LoraConfig.{key}="):
        MergedLoraSources(pm, rank=0, world_size=2)


def test_non_linear_targets_merged_or_disabled_adapters_and_other_peft_types_are_refused_by_name():
    torch.manual_seed(0)
    emb = peft.get_peft_model(_Tiny(), peft.LoraConfig(r=4, target_modules=["q", "emb"]))
    with pytest.raises(ConfigError, match=r"'emb'.*torch.nn.modules.sparse.Embedding"):
        MergedLoraSources(emb, rank=0, world_size=1)
    pm = _peft()
    pm.get_base_model().q.merge()
    with pytest.raises(ConfigError, match=r"'q'.*already merged"):
        MergedLoraSources(pm, rank=0, world_size=1)
    pm = _peft()
    with pm.disable_adapter():
        with pytest.raises(ConfigError, match="adapters are disabled"):
            MergedLoraSources(pm, rank=0, world_size=1)
    ia3 = peft.get_peft_model(_Tiny(), peft.IA3Config(target_modules=["q", "up"], feedforward_modules=["up"]))
    with pytest.raises(ConfigError, match="is IA3, not LoRA: not supported by the merged LoRA sync"):
        MergedLoraSources(ia3, rank=0, world_size=1)
