"""duoserve: expert predictors and dual-phase offload for Mixture-of-Experts inference."""

__version__ = "0.1.0"


def load_predictor(path, device="cpu"):
    """Load an exported predictor artifact with torch alone (see duoserve.predictor)."""
    from duoserve.predictor.artifact import load_predictor as _load

    return _load(path, device)
