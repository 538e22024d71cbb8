"""Progress bars for the island's long waits (INIT upload, initial cut, final cut): tqdm, off with
YETO_PROGRESS=0 (IslandConfig.progress)."""
from __future__ import annotations


def progress_bar(total: int, desc: str, enabled: bool, unit: str = "B"):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", disable=not enabled, leave=False)


__all__ = ["progress_bar"]
