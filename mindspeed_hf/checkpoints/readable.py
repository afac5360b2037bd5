"""Whether a checkpoint's files read whole, without loading them: safetensors headers and data ranges, torch.save's
zip directory, JSON files, and a torch.distributed.checkpoint directory's metadata and the byte ranges it stores.
A killed save (a file cut short) or a damaged disk is found here before anything is loaded."""

from __future__ import annotations

import json
import os
import struct
import zipfile

from ..parallel.checkpoint import COMPLETE_MARKER

__all__ = ["unreadable_file"]

_TORCH_SAVED = (".pt", ".pth", ".bin")


def _safetensors_problem(path: str, size: int) -> str | None:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return "truncated (no header)"
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            return "truncated (header cut)"
        try:
            header = json.loads(f.read(length))
        except ValueError:
            return "corrupt header"
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    return None if 8 + length + end <= size else f"truncated ({size} of {8 + length + end} bytes)"


def _torch_file_problem(path: str, size: int) -> str | None:
    """torch.save's zip format: the central directory is at the end, so a cut file has none."""
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if info.header_offset + info.compress_size > size:
                    return f"truncated ({info.filename} cut)"
    except (zipfile.BadZipFile, OSError):
        return "truncated or not a torch.save file"
    return None


def _dcp_problem(directory: str) -> str | None:
    """A torch.distributed.checkpoint directory: its .metadata readable, every stored byte range present."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(directory).read_metadata()
    except Exception:  # noqa: BLE001 - any failure to unpickle is a damaged file
        return f"{os.path.join(directory, '.metadata')}: truncated or corrupt"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        path = os.path.join(directory, name)
        have = os.path.getsize(path) if os.path.isfile(path) else -1
        if have < end:
            return f"{path}: {'missing' if have < 0 else f'truncated ({have} of {end} bytes)'}"
    return None


def unreadable_file(checkpoint: str) -> str | None:
    """"FILE: what is wrong" for the first file of `checkpoint` that cannot be read whole (weights, optimizer,
    scheduler, RNG state, trainer state, DCP shards), None when all can. Reads headers and indexes only."""
    for root, dirs, files in os.walk(checkpoint):
        dirs.sort()
        if ".metadata" in files:
            problem = _dcp_problem(root)
            if problem:
                return problem
        for name in sorted(files):
            path = os.path.join(root, name)
            size = os.path.getsize(path)
            problem = None
            if name.endswith(".safetensors"):
                problem = _safetensors_problem(path, size)
            elif name.endswith(_TORCH_SAVED):
                problem = _torch_file_problem(path, size)
            elif name.endswith(".json") or name == COMPLETE_MARKER:
                try:
                    with open(path) as f:
                        json.load(f)
                except ValueError:
                    problem = "truncated or not valid JSON"
            if problem:
                return f"{path}: {problem}"
    return None
