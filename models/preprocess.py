"""Tenant preprocessor: raw observations of one tenant -> canonical VLAFeature batches.

    pre = TenantPreprocessor.for_base(schema, base)
    batch = pre([Observation(images={"agentview": rgb_u8_HxWx3, "wrist": ...},
                             state=np.zeros(8, np.float32), instruction="open the drawer")])

Camera i of the schema fills slot i; slots past the tenant's cameras, and cameras passed as
None, are absent (zero image, mask False). Frames are resized with torch bilinear + antialias
(no torchvision). The instruction goes through the tenant template, then the base template,
then is truncated to layout.max_prompt_tokens (the start is kept: it holds the task words).
State is zero-padded to layout.max_state_dim with a mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from models.errors import InputError, SchemaError
from models.features import VLABatch
from models.schema import CompatibilityKey, TenantSchema

# Distinct instructions per tenant are few (tasks); cache their token ids, bounded.
_PROMPT_CACHE_MAX = 4096


@dataclass
class Observation:
    """One raw observation. images: camera name -> uint8 (H, W, 3) array, or None if not captured."""

    images: Mapping[str, np.ndarray | None]
    state: np.ndarray | Sequence[float]
    instruction: str


class TenantPreprocessor:
    def __init__(self, schema: TenantSchema, key: CompatibilityKey, encode_prompt: Callable[[str], list[int]]) -> None:
        layout = key.layout
        if len(schema.cameras) > layout.camera_slots:
            raise SchemaError(
                f"cameras: {len(schema.cameras)} declared, the base layout has {layout.camera_slots} camera slots"
            )
        if schema.state_dim > layout.max_state_dim:
            raise SchemaError(f"state_dim={schema.state_dim}: the base layout allows at most {layout.max_state_dim}")
        self.schema = schema
        self.key = key
        self._encode_prompt = encode_prompt
        self._prompt_cache: dict[str, list[int]] = {}

    @classmethod
    def for_base(cls, schema: TenantSchema, base, layout=None) -> "TenantPreprocessor":
        """Preprocessor for `base` (a models.base.BaseModel). A schema with more cameras than the
        base's default slots gets a wider layout, hence its own compatibility key."""
        from dataclasses import replace

        layout = layout or base.layout
        if len(schema.cameras) > layout.camera_slots:
            layout = replace(layout, camera_slots=len(schema.cameras))
        return cls(schema, base.key_for(layout), base.encode_prompt)

    def prompt_ids(self, instruction: str) -> list[int]:
        if not isinstance(instruction, str):
            raise InputError(f"instruction: must be str, got {type(instruction).__name__}")
        ids = self._prompt_cache.get(instruction)
        if ids is None:
            text = self.schema.instruction_template.format(instruction=instruction)
            ids = self._encode_prompt(text)[: self.key.layout.max_prompt_tokens]
            if len(self._prompt_cache) >= _PROMPT_CACHE_MAX:
                self._prompt_cache.clear()
            self._prompt_cache[instruction] = ids
        return ids

    def __call__(self, observations: Sequence[Observation], device: torch.device | str | None = None) -> VLABatch:
        """``device``: where images are resized (a serving process passes its accelerator, so
        the uint8 frames cross once and the resize runs there); other fields stay on CPU."""
        if isinstance(observations, Observation):
            observations = [observations]
        if not observations:
            raise InputError("observations: empty batch")
        lay = self.key.layout
        b = len(observations)
        images = torch.zeros(b, lay.camera_slots, 3, *lay.image_size, device=device)
        image_mask = torch.zeros(b, lay.camera_slots, dtype=torch.bool)
        prompt_ids = torch.zeros(b, lay.max_prompt_tokens, dtype=torch.long)
        prompt_len = torch.zeros(b, dtype=torch.long)
        state = torch.zeros(b, lay.max_state_dim)
        state_mask = torch.zeros(b, lay.max_state_dim, dtype=torch.bool)
        state_mask[:, : self.schema.state_dim] = True

        for i, obs in enumerate(observations):
            self._check_camera_names(obs)
            ids = self.prompt_ids(obs.instruction)
            prompt_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            prompt_len[i] = len(ids)
            state[i, : self.schema.state_dim] = self._state(obs.state)

        # Resize per camera for the whole batch at once: one interpolate call per slot.
        for s, cam in enumerate(self.schema.cameras):
            rows = [i for i, o in enumerate(observations) if o.images.get(cam.name) is not None]
            if not rows:
                continue
            frames = np.stack([self._frame(observations[i].images[cam.name], cam) for i in rows])
            x = torch.from_numpy(frames).to(images.device).permute(0, 3, 1, 2).float().div_(255.0)
            if tuple(x.shape[-2:]) != lay.image_size:
                x = F.interpolate(x, size=lay.image_size, mode="bilinear", antialias=True, align_corners=False)
                x = x.clamp_(0.0, 1.0)
            images[rows, s] = x
            image_mask[rows, s] = True
        return VLABatch(self.key, images, image_mask, prompt_ids, prompt_len, state, state_mask)

    # ---- checks -------------------------------------------------------------------------
    def _check_camera_names(self, obs: Observation) -> None:
        unknown = set(obs.images) - set(self.schema.camera_names)
        if unknown:
            raise InputError(f"images: unknown cameras {sorted(unknown)}; schema has {list(self.schema.camera_names)}")
        missing = set(self.schema.camera_names) - set(obs.images)
        if missing:
            raise InputError(f"images: cameras {sorted(missing)} missing (pass None for a frame not captured)")

    @staticmethod
    def _frame(frame: np.ndarray, cam) -> np.ndarray:
        if not isinstance(frame, np.ndarray) or frame.dtype != np.uint8:
            raise InputError(f"images[{cam.name}]: must be a uint8 numpy array, got {getattr(frame, 'dtype', type(frame))}")
        if frame.shape != (cam.height, cam.width, 3):
            raise InputError(f"images[{cam.name}]: shape {frame.shape}, schema declares {(cam.height, cam.width, 3)}")
        return frame

    def _state(self, state) -> torch.Tensor:
        # np.array copies: ``state`` may be a read-only array (a decoded message, pyarrow, a
        # caller's view), and torch.from_numpy must never alias memory it may not write.
        arr = np.array(state, dtype=np.float32)
        if arr.shape != (self.schema.state_dim,):
            raise InputError(f"state: shape {arr.shape}, schema declares ({self.schema.state_dim},)")
        if not np.isfinite(arr).all():
            raise InputError("state: contains NaN or inf")
        return torch.from_numpy(arr)
