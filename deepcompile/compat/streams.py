"""Streams created in C++, as torch stream objects."""

from __future__ import annotations

import torch

_CUDA = 1  # c10::DeviceType::CUDA


def stream_from_ids(stream_id: int, device_index: int, device_type: int):
    """The torch stream object for a c10 stream given as ``(stream_id, device_index,
    device_type)`` (``c10::Stream::pack3``): a ``torch.cuda.Stream`` for CUDA, else a
    ``torch.Stream``. Relies on both accepting those three keywords, which is how
    ``torch.cuda.current_stream`` builds its result."""
    kwargs = dict(stream_id=int(stream_id), device_index=int(device_index), device_type=int(device_type))
    if int(device_type) == _CUDA:
        return torch.cuda.Stream(**kwargs)
    return torch.Stream(**kwargs)
