"""Built-in base presets: HF configs only, random init, nothing downloaded.

`tiny-*` presets are for tests (a forward in milliseconds on CPU); `qwen3-vl-{2b,4b,8b}` copy the
published Qwen3-VL-*-Instruct shapes for benchmarks (random weights: the speed is real, the
outputs are not). Token ids of tiny presets live in a small vocabulary that `ByteTokenizer`
(bytes at ids 4..259) fits inside.

Add a preset by adding a `Preset` to `PRESETS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from models.errors import UnknownNameError

# Family names: which input builder and forward a base uses (`models.families`).
QWEN3_VL = "qwen3_vl"
PALIGEMMA = "paligemma"
IDEFICS3 = "idefics3"

# Special ids of tiny presets: above the 260 ids ByteTokenizer uses, below the tiny vocab.
TINY_VOCAB = 512
TINY_IDS = {
    "pad": 0,
    "bos": 1,
    "query": 2,
    "image": 300,
    "video": 301,
    "vision_start": 302,
    "vision_end": 303,
    "fake_image": 304,
    "global_image": 305,
}
# The published full-size presets use the real tokenizer's special ids (Qwen2 tokenizer).
QWEN_IDS = {
    "pad": 151643,
    "bos": 151644,  # <|im_start|>
    "query": 151643,  # <|endoftext|>: OFT-style readout slots carry no meaning of their own
    "image": 151655,
    "video": 151656,
    "vision_start": 151652,
    "vision_end": 151653,
}


@dataclass(frozen=True)
class Preset:
    name: str
    family: str
    build_config: Callable[[int | None], Any]  # image_size override -> HF config
    token_ids: dict[str, int]
    default_image_size: int


def _tiny_qwen3_vl(image_size: int | None) -> Any:
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [4, 2, 2], "mrope_interleaved": True},
            pad_token_id=TINY_IDS["pad"],
        ),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
            spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
            num_position_embeddings=256, deepstack_visual_indexes=[1],
        ),
        image_token_id=TINY_IDS["image"], video_token_id=TINY_IDS["video"],
        vision_start_token_id=TINY_IDS["vision_start"], vision_end_token_id=TINY_IDS["vision_end"],
    )


def _qwen3_vl(text: dict[str, int], vision: dict[str, Any]) -> Callable[[int | None], Any]:
    # Shapes of Qwen/Qwen3-VL-{2B,4B,8B}-Instruct config.json.
    def build(image_size: int | None) -> Any:
        from transformers import Qwen3VLConfig

        return Qwen3VLConfig(
            text_config=dict(
                vocab_size=151936, head_dim=128, max_position_embeddings=262144, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                 "mrope_section": [24, 20, 20], "mrope_interleaved": True},
                **text,
            ),
            vision_config=dict(
                hidden_act="gelu_pytorch_tanh", in_channels=3, patch_size=16, spatial_merge_size=2,
                temporal_patch_size=2, num_position_embeddings=2304, num_heads=16, **vision,
            ),
            image_token_id=QWEN_IDS["image"], video_token_id=QWEN_IDS["video"],
            vision_start_token_id=QWEN_IDS["vision_start"], vision_end_token_id=QWEN_IDS["vision_end"],
        )

    return build


def _tiny_paligemma(image_size: int | None) -> Any:
    from transformers import PaliGemmaConfig

    size = image_size or 224
    return PaliGemmaConfig(
        vision_config=dict(
            model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, image_size=size, patch_size=16, projection_dim=64,
        ),
        text_config=dict(
            model_type="gemma", vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
            pad_token_id=TINY_IDS["pad"], bos_token_id=TINY_IDS["bos"],
        ),
        image_token_id=TINY_IDS["image"], vocab_size=TINY_VOCAB, projection_dim=64, hidden_size=64,
    )


def _tiny_smolvlm(image_size: int | None) -> Any:
    from transformers import Idefics3Config

    size = image_size or 224
    return Idefics3Config(
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            image_size=size, patch_size=16,
        ),
        text_config=dict(
            model_type="llama", vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            pad_token_id=TINY_IDS["pad"], bos_token_id=TINY_IDS["bos"],
        ),
        image_token_id=TINY_IDS["image"], scale_factor=2,
    )


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset("tiny-qwen3-vl", QWEN3_VL, _tiny_qwen3_vl, TINY_IDS, 224),
        # The same tiny model at the built-in task's 64x64 resolution: CPU RL, SFT and serving
        # at millisecond forwards (at 224 the vision tokens dominate a CPU forward).
        Preset("tiny-qwen3-vl-64", QWEN3_VL, _tiny_qwen3_vl, TINY_IDS, 64),
        Preset("tiny-paligemma", PALIGEMMA, _tiny_paligemma, TINY_IDS, 224),
        Preset("tiny-smolvlm", IDEFICS3, _tiny_smolvlm, TINY_IDS, 224),
        Preset(
            "qwen3-vl-2b", QWEN3_VL,
            _qwen3_vl(dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                           num_attention_heads=16, num_key_value_heads=8),
                      dict(depth=24, hidden_size=1024, intermediate_size=4096, out_hidden_size=2048,
                           deepstack_visual_indexes=[5, 11, 17])),
            QWEN_IDS, 224,
        ),
        Preset(
            "qwen3-vl-4b", QWEN3_VL,
            _qwen3_vl(dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                           num_attention_heads=32, num_key_value_heads=8),
                      dict(depth=24, hidden_size=1024, intermediate_size=4096, out_hidden_size=2560,
                           deepstack_visual_indexes=[5, 11, 17])),
            QWEN_IDS, 224,
        ),
        Preset(
            "qwen3-vl-8b", QWEN3_VL,
            _qwen3_vl(dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                           num_attention_heads=32, num_key_value_heads=8),
                      dict(depth=27, hidden_size=1152, intermediate_size=4304, out_hidden_size=4096,
                           deepstack_visual_indexes=[8, 16, 24])),
            QWEN_IDS, 224,
        ),
    ]
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise UnknownNameError(f"unknown base preset {name!r}; known: {sorted(PRESETS)}") from None
