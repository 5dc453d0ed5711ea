"""Stage 4: traces + predictor -> accuracy report (exact-top-k, at-least-half, recall, every baseline, plots).

Scoring imports no Lightning; only the cross-task and learning-curve studies, which fit fresh
predictors, import the training stage.
"""
