"""Numpy rasteriser for the built-in 2-D tasks: filled discs seen by axis-aligned cameras.

    cam = DiscCamera(height=64, width=64, background=(205, 205, 205), outside=(70, 70, 70))
    img_HWC = cam.render(center_xy=(0, 0), half_extent=1.0, discs=[(x, y, r, (255, 0, 0)), ...])

World coordinates: x to the right, y up; the workspace is [-1, 1]^2. Each disc only touches
the pixels of its bounding box, so a 64x64 frame with four discs costs tens of microseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

WORKSPACE_HALF_EXTENT = 1.0

Disc = tuple[float, float, float, tuple[int, int, int]]  # x, y, radius, rgb


class DiscCamera:
    def __init__(
        self,
        height: int,
        width: int,
        background: tuple[int, int, int],
        outside: tuple[int, int, int],
    ) -> None:
        self.height = height
        self.width = width
        self._background = np.asarray(background, np.uint8)
        self._outside = np.asarray(outside, np.uint8)
        # Pixel-centre offsets in [-1, 1]: row 0 is the top of the image (largest y).
        self._u_W = (np.arange(width, dtype=np.float64) + 0.5) / width * 2.0 - 1.0
        self._v_H = 1.0 - (np.arange(height, dtype=np.float64) + 0.5) / height * 2.0

    def render(self, center_xy: Sequence[float], half_extent: float, discs: Sequence[Disc]) -> np.ndarray:
        cx, cy = float(center_xy[0]), float(center_xy[1])
        xs_W = cx + half_extent * self._u_W
        ys_H = cy + half_extent * self._v_H
        img = np.empty((self.height, self.width, 3), np.uint8)
        img[:] = self._background
        # Paint what lies outside the workspace, so an off-centre (wrist) view shows the walls.
        out_W = np.abs(xs_W) > WORKSPACE_HALF_EXTENT
        out_H = np.abs(ys_H) > WORKSPACE_HALF_EXTENT
        if out_W.any():
            img[:, out_W] = self._outside
        if out_H.any():
            img[out_H, :] = self._outside
        px_per_unit_x = self.width / (2.0 * half_extent)
        px_per_unit_y = self.height / (2.0 * half_extent)
        for x, y, r, rgb in discs:
            # Bounding box in pixel indices, clipped to the image.
            c0 = max(0, math.floor((x - r - xs_W[0]) * px_per_unit_x))
            c1 = min(self.width, math.ceil((x + r - xs_W[0]) * px_per_unit_x) + 1)
            r0 = max(0, math.floor((ys_H[0] - (y + r)) * px_per_unit_y))
            r1 = min(self.height, math.ceil((ys_H[0] - (y - r)) * px_per_unit_y) + 1)
            if c0 >= c1 or r0 >= r1:
                continue
            dx = xs_W[c0:c1] - x
            dy = ys_H[r0:r1] - y
            mask = dy[:, None] ** 2 + dx[None, :] ** 2 <= r * r
            img[r0:r1, c0:c1][mask] = rgb
        return img
