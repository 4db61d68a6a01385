"""Whether a command can write where a flag points, checked before any work (``--plot``, ``--metrics``,
``--calibrate``, ``--checkpoint-dir``): a mistyped folder is one line naming the flag, not a traceback
after minutes of training or planning."""

from __future__ import annotations

import os

__all__ = ["file_problems", "folder_problems"]


def file_problems(flag: str, path: str) -> list[str]:
    """A file to write or append to: its folder must exist and be writable, and it must not be a folder."""
    if os.path.isdir(path):
        return [f"{flag} {path} is a folder: name a file (in it, or elsewhere)"]
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return [f"{flag} {path}: the folder {folder} does not exist"]
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return [f"{flag} {path}: cannot write there (permission denied)"]
    return []


def folder_problems(flag: str, path: str) -> list[str]:
    """A folder to write into, created with its parents if missing: what exists of it must be folders,
    and the nearest one writable."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        what = path if existing == os.path.abspath(path) else f"{path}: {existing}"
        return [f"{flag} {what} is a file, not a folder"]
    if not os.access(existing, os.W_OK):
        return [f"{flag} {path}: cannot write in {existing} (permission denied)"]
    return []
