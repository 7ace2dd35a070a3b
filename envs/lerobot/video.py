"""PyAV video access for LeRobot datasets: timestamp-exact frame lookup and an mp4 encoder.

Lookup follows lerobot (`video_utils.decode_video_frames_*`): a query timestamp is the
episode's ``from_timestamp`` (meta/episodes) plus the frame's ``timestamp`` (data parquet);
frames are decoded from the keyframe at or before the first query up to the last one, and
each query takes the decoded frame with the nearest presentation time, which must lie within
``tolerance_s`` (lerobot's default 1e-4 s).

    decoder = VideoDecoder(max_open=8)
    frames_THWC = decoder.decode_at(path, query_ts)     # uint8 RGB
    decoder.close()

    enc = VideoEncoder(path, fps=10, height=64, width=64)   # libsvtav1, yuv420p, g=2, crf=30
    enc.write(frame_HWC, keyframe=True); enc.close()
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from pathlib import Path

import av
import numpy as np

from envs.errors import DatasetFormatError, DatasetNotFoundError, FrameTimestampError
from envs.lerobot import constants as C

# lerobot's encoder defaults (video_utils.encode_video_frames): AV1 through SVT-AV1, a
# keyframe every 2 frames (cheap random access), crf 30.
DEFAULT_VCODEC = "libsvtav1"
DEFAULT_PIX_FMT = "yuv420p"
DEFAULT_GOP = 2
DEFAULT_CRF = 30

# SVT-AV1 prints a banner to stderr for every encoder unless told otherwise (1 = errors only).
os.environ.setdefault("SVT_LOG", "1")
logging.getLogger("libav").setLevel(logging.ERROR)


class VideoDecoder:
    """Keeps up to `max_open` containers open (LRU), so random access skips re-opening files."""

    def __init__(self, max_open: int = 8, tolerance_s: float = C.DEFAULT_TOLERANCE_S) -> None:
        self.max_open = max_open
        self.tolerance_s = tolerance_s
        self._open: OrderedDict[Path, av.container.InputContainer] = OrderedDict()

    def _container(self, path: Path) -> av.container.InputContainer:
        if path in self._open:
            self._open.move_to_end(path)
            return self._open[path]
        if not path.is_file():
            raise DatasetNotFoundError(f"video file missing: {path}", details={"path": str(path)})
        try:
            container = av.open(str(path))
        except av.error.FFmpegError as e:
            raise DatasetFormatError(f"cannot open video {path}: {e}") from None
        if not container.streams.video:
            container.close()
            raise DatasetFormatError(f"{path}: has no video stream")
        self._open[path] = container
        while len(self._open) > self.max_open:
            _, old = self._open.popitem(last=False)
            old.close()
        return container

    def decode_at(self, path: Path, query_ts: np.ndarray) -> np.ndarray:
        """uint8 (len(query_ts), H, W, 3) RGB frames nearest to each query timestamp (seconds)."""
        query_ts = np.asarray(query_ts, np.float64)
        container = self._container(path)
        stream = container.streams.video[0]
        first, last = float(query_ts.min()), float(query_ts.max())
        # Seek lands on the keyframe at or before `first`; offsets are in stream time_base units.
        container.seek(max(0, int(first / stream.time_base)), stream=stream, backward=True, any_frame=False)
        frames: list[np.ndarray] = []
        times: list[float] = []
        try:
            for frame in container.decode(stream):
                if frame.pts is None:
                    continue
                t = float(frame.pts * stream.time_base)
                if t < first - self.tolerance_s:
                    continue  # before the first query: only needed to decode forward
                frames.append(frame.to_ndarray(format="rgb24"))
                times.append(t)
                if t >= last:
                    break
        except av.error.FFmpegError as e:
            raise DatasetFormatError(f"decoding {path} failed: {e}") from None
        if not frames:
            raise FrameTimestampError(f"{path}: no frame decoded at or after {first:.6f}s (file too short?)")
        loaded = np.asarray(times)
        nearest = np.abs(query_ts[:, None] - loaded[None, :]).argmin(axis=1)
        err = np.abs(loaded[nearest] - query_ts)
        if (err >= self.tolerance_s).any():
            bad = int(err.argmax())
            raise FrameTimestampError(
                f"{path}: query timestamp {query_ts[bad]:.6f}s has no frame within {self.tolerance_s}s "
                f"(nearest decoded {loaded[nearest[bad]]:.6f}s; decoded {loaded.min():.6f}..{loaded.max():.6f}s)"
            )
        return np.stack([frames[i] for i in nearest])

    def close(self) -> None:
        while self._open:
            _, c = self._open.popitem()
            c.close()


# Linux capability of changing scheduling policies (capability(7)); capget/capset's v3 ABI.
_CAP_SYS_NICE = 23
_CAP_V3 = 0x20080522


def no_realtime_in_this_thread() -> None:
    """Drop CAP_SYS_NICE from the calling thread (and so from the threads it starts).

    Why: the libsvtav1 encoder (lerobot's default AV1 codec, bundled with PyAV) sets the
    thread that opens it, and its own worker threads, to SCHED_FIFO priority 99 whenever it
    may, i.e. as root. The thread then stays real-time after the encode: every process it
    forks later (an env worker's, a test's `nexus up`) starts real-time too, and a real-time
    nats-server or role at 100 % CPU starves every other process on the host (seen: a
    deployment hung for 30 minutes). Without the capability the encoder's request fails and
    it encodes as usual at normal priority. Capabilities are per thread on Linux, so only
    the encoding thread and what it starts lose it. Elsewhere (not Linux) a no-op."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    header, data = Header(_CAP_V3, 0), (Data * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget: cannot read this thread's capabilities")
    word, bit = divmod(_CAP_SYS_NICE, 32)
    if not (data[word].effective | data[word].permitted) & (1 << bit):
        return  # not held (not root, or dropped before): nothing to do
    data[word].effective &= ~(1 << bit)
    data[word].permitted &= ~(1 << bit)
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset: cannot drop CAP_SYS_NICE")


class VideoEncoder:
    """Appends RGB frames to one mp4; the presentation time of frame n is n / fps.

    Every call drops CAP_SYS_NICE from its thread first (`no_realtime_in_this_thread`): the
    encoder starts its threads at the first frame, from whichever thread writes it."""

    def __init__(
        self,
        path: Path,
        fps: int,
        height: int,
        width: int,
        vcodec: str = DEFAULT_VCODEC,
        pix_fmt: str = DEFAULT_PIX_FMT,
        gop: int | None = DEFAULT_GOP,
        crf: int | None = DEFAULT_CRF,
    ) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        no_realtime_in_this_thread()
        self.path = path
        self.vcodec = vcodec
        self.pix_fmt = pix_fmt
        options = {}
        if gop is not None:
            options["g"] = str(gop)
        if crf is not None and vcodec != "mpeg4":  # mpeg4 has no crf; it takes qscale
            options["crf"] = str(crf)
        self._container = av.open(str(path), "w")
        self._stream = self._container.add_stream(vcodec, rate=fps, options=options)
        self._stream.pix_fmt = pix_fmt
        self._stream.height = height
        self._stream.width = width
        self.frames_written = 0
        self.bytes_written = 0

    def write(self, frame_HWC: np.ndarray, keyframe: bool = False) -> None:
        no_realtime_in_this_thread()
        frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame_HWC, np.uint8), format="rgb24")
        frame.pts = self.frames_written
        if keyframe:
            # Each episode starts on a keyframe, like lerobot's per-episode encodes concatenated.
            frame.pict_type = av.video.frame.PictureType.I
        self._mux(self._stream.encode(frame))
        self.frames_written += 1

    def _mux(self, packets: list[av.Packet]) -> None:
        for p in packets:
            self.bytes_written += p.size
            self._container.mux(p)

    def close(self) -> None:
        no_realtime_in_this_thread()
        if self._container is None:
            return
        self._mux(self._stream.encode(None))
        self._container.close()
        self._container = None
