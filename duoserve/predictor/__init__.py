"""The predictor artifact: model definition, export and torch-only loading (no Lightning).

The runtime and evaluation import only this subpackage to use a trained predictor.
"""

from duoserve.predictor.artifact import load_predictor, save_predictor, trained_requests
from duoserve.predictor.fast import TrainedPredictor
from duoserve.predictor.model import PAPER_WIDTHS, ExpertPredictor, FeatureSpec

__all__ = ["PAPER_WIDTHS", "ExpertPredictor", "FeatureSpec", "TrainedPredictor", "load_predictor", "save_predictor",
           "trained_requests"]
