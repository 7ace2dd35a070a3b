"""Base input building without processors, checked against transformers itself, and the
batch invariance that group batching relies on, for every tiny family."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import dataclasses

import numpy as np
import pytest
import torch

from models import BaseConfig, BaseModel, InputError, TenantPreprocessor, VLABatch
from models.testing import libero_schema, random_observations

torch.set_num_threads(1)
PRESETS = ["tiny-qwen3-vl", "tiny-paligemma", "tiny-smolvlm"]


@pytest.fixture(scope="module")
def bases() -> dict[str, BaseModel]:
    return {p: BaseModel.load(BaseConfig(p, image_size=64, device="cpu")) for p in PRESETS}


def batch_for(base: BaseModel, n: int = 3, seed: int = 0, drop_wrist_row: int | None = 1) -> VLABatch:
    pre = TenantPreprocessor.for_base(libero_schema(), base)
    obs = random_observations(pre.schema, n, np.random.default_rng(seed))
    if drop_wrist_row is not None:
        obs[drop_wrist_row].images = dict(obs[drop_wrist_row].images, wrist=None)
    return pre(obs)


def test_tiny_forward_is_fast(bases) -> None:
    import time

    for name, base in bases.items():
        vla = batch_for(base, n=2)
        base.encode(vla)
        t0 = time.perf_counter()
        base.encode(vla)
        dt = time.perf_counter() - t0
        assert dt < 0.5, f"{name}: tiny forward took {dt * 1e3:.0f} ms"


# ---- Qwen3-VL: our inputs vs transformers' own ------------------------------------------------
def test_qwen_position_ids_match_transformers_get_rope_index(bases) -> None:
    base = bases["tiny-qwen3-vl"]
    vla = batch_for(base, n=3)
    kw = base.build_inputs(vla).kwargs
    ref, _ = base.core.get_rope_index(input_ids=kw["input_ids"], mm_token_type_ids=kw["mm_token_type_ids"],
                                      image_grid_thw=kw["image_grid_thw"], attention_mask=kw["attention_mask"])
    assert torch.equal(kw["position_ids"], ref)
    # Masked rows exist (absent wrist camera, prompt padding), so skipping was exercised.
    assert (kw["attention_mask"] == 0).any()


def test_qwen_hidden_states_match_transformers_computing_positions(bases) -> None:
    base = bases["tiny-qwen3-vl"]
    vla = batch_for(base, n=2)
    kw = base.build_inputs(vla).kwargs
    ours = base.encode(vla).hidden_B_L_D
    hf_kw = {k: v for k, v in kw.items() if k != "position_ids"}
    base.core.rope_deltas = None
    with torch.no_grad():
        ref = base.core(**hf_kw, use_cache=False).last_hidden_state
    assert torch.allclose(ours, ref, atol=1e-5, rtol=1e-5)


def test_qwen_missing_mm_token_type_ids_changes_hidden_states(bases) -> None:
    base = bases["tiny-qwen3-vl"]
    vla = batch_for(base, n=2, drop_wrist_row=None)
    inputs = base.build_inputs(vla)
    kw = inputs.kwargs
    family = base.family
    # What a builder that dropped mm_token_type_ids would compute: every token as text.
    no_types = torch.zeros_like(kw["mm_token_type_ids"])
    wrong = dict(kw, mm_token_type_ids=no_types,
                 position_ids=family.position_ids(no_types, kw["attention_mask"], vla.key.layout))
    with torch.no_grad():
        good = base.core(**kw, use_cache=False).last_hidden_state
        bad = base.core(**wrong, use_cache=False).last_hidden_state
    assert not torch.allclose(good, bad, atol=1e-4)
    # And transformers, left to compute positions, refuses images without mm_token_type_ids
    # (older versions silently fell back to 1-D positions: hidden states differ as above).
    hf_kw = {k: v for k, v in kw.items() if k not in ("position_ids", "mm_token_type_ids")}
    base.core.rope_deltas = None
    try:
        with torch.no_grad():
            silent = base.core(**hf_kw, use_cache=False).last_hidden_state
    except ValueError as e:
        assert "mm_token_type_ids" in str(e)
    else:
        assert not torch.allclose(good, silent, atol=1e-4)


def test_qwen_wrong_placeholder_count_errors(bases) -> None:
    base = bases["tiny-qwen3-vl"]
    vla = batch_for(base, n=2)
    kw = base.build_inputs(vla).kwargs
    ids = kw["input_ids"].clone()
    first = int((ids[0] == base.family.ids.image).nonzero()[0])
    ids[0, first] = base.family.ids.pad  # one placeholder short
    with pytest.raises(InputError, match="placeholders"):
        base.family.check_placeholders(ids, base.family.ids.image, int((kw["input_ids"] == base.family.ids.image).sum()))
    with pytest.raises(ValueError, match="do not match"):
        with torch.no_grad():
            base.core(**dict(kw, input_ids=ids), use_cache=False)
    # Our builder checks too: a layout whose skeleton was built for another resolution is refused.
    bad_family = base.family
    sk = bad_family.skeleton(vla.key.layout, base.lead_ids)
    bad_family._skeletons[vla.key.layout] = dataclasses.replace(sk, ids_L=torch.where(
        sk.ids_L == bad_family.ids.image, torch.full_like(sk.ids_L, bad_family.ids.pad), sk.ids_L))
    try:
        with pytest.raises(InputError, match="placeholders"):
            base.encode(vla)
    finally:
        bad_family._skeletons[vla.key.layout] = sk


def test_qwen_pixel_layout_matches_hf_image_processor(bases) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    base = bases["tiny-qwen3-vl"]
    img = np.random.default_rng(3).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    proc = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3, min_pixels=32 * 32, max_pixels=64 * 64)
    ref = proc(images=[img], return_tensors="pt")
    x = torch.from_numpy(img).permute(2, 0, 1)[None].float() / 255.0
    ours = base.family.patchify(base.family.normalize(x, torch.float32))
    assert ref["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert ours.shape == ref["pixel_values"].shape
    assert torch.allclose(ours, ref["pixel_values"].float(), atol=1e-5)


def test_qwen_layout_must_fit_patches() -> None:
    from models import SchemaError

    with pytest.raises(SchemaError, match="multiple of 32"):
        BaseModel.load(BaseConfig("tiny-qwen3-vl", image_size=48, device="cpu"))


# ---- every family ------------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_batch_invariance(bases, preset: str) -> None:
    """A sample's features do not depend on its batch-mates: what group batching relies on."""
    base = bases[preset]
    vla = batch_for(base, n=3)
    together = base.encode(vla)
    for i in range(3):
        alone = base.encode(vla.index(slice(i, i + 1)))
        assert torch.allclose(together.hidden_B_L_D[i], alone.hidden_B_L_D[0], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(together.hidden_B_L_D).all()
    assert together.query_B_Q_D.shape == (3, vla.key.layout.num_query_tokens, base.hidden_size)


@pytest.mark.parametrize("preset", PRESETS)
def test_absent_slot_pixels_do_not_matter(bases, preset: str) -> None:
    base = bases[preset]
    vla = batch_for(base, n=2, drop_wrist_row=0)
    noisy = dataclasses.replace(vla, images_B_S_C_H_W=vla.images_B_S_C_H_W.clone())
    noisy.images_B_S_C_H_W[0, 1] = torch.rand_like(noisy.images_B_S_C_H_W[0, 1])
    a, b = base.encode(vla), base.encode(noisy)
    keep = a.mask_B_L[0]
    assert torch.allclose(a.hidden_B_L_D[0][keep], b.hidden_B_L_D[0][keep], atol=1e-5)


@pytest.mark.parametrize("preset", PRESETS)
def test_save_pretrained_directory_loads_identically(bases, preset: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    base = bases[preset]
    base.core.config.save_pretrained(tmp_path)
    base.save_pretrained(tmp_path)
    loaded = BaseModel.load(BaseConfig(str(tmp_path), image_size=64, device="cpu"))
    assert loaded.family.name == base.family.name
    vla_dir = TenantPreprocessor.for_base(libero_schema(), loaded)(
        random_observations(libero_schema(), 2, np.random.default_rng(0)))
    ref = base.encode(batch_for(base, n=2, drop_wrist_row=None))
    got = loaded.encode(vla_dir)
    assert torch.allclose(ref.hidden_B_L_D, got.hidden_B_L_D, atol=1e-5)
    assert loaded.key != base.key  # different base ids never share a forward


def test_batch_from_another_base_is_refused(bases) -> None:
    from models import IncompatibleBatchError

    vla = batch_for(bases["tiny-paligemma"], n=1, drop_wrist_row=None)
    with pytest.raises(IncompatibleBatchError):
        bases["tiny-qwen3-vl"].encode(vla)
