"""Model pipelines. The trained embedded default's files (the "toy" preset) ship beside the code."""

from pathlib import Path

TOY_WEIGHTS = Path(__file__).resolve().parents[1] / "weights" / "toy"
