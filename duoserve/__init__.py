"""duoserve: expert predictors and dual-phase offload for Mixture-of-Experts inference."""

__version__ = "0.1.0"
