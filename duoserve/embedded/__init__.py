"""The embedded default: a tiny MoE checkpoint the project trains itself.

``scripts/train_embedded_moe.py`` re-creates it from the built-in task samples.
"""

from pathlib import Path

EMBEDDED_MODEL = Path(__file__).parent / "tiny-moe"
EMBEDDED_NAME = "embedded"  # what --model takes to mean EMBEDDED_MODEL
