"""Losses registered in mmdet's ``MODELS``: the D-FINE / DEIMv2 set criterion and its terms."""
from .dfine_criterion import (DFineCriterion, HungarianMatcher, PredictionSet, dense_one_to_one,
                              dfine_prediction_sets)
from .dfine_terms import Matched, box_losses, ddf_loss, fgl_loss, mal_loss, vfl_loss

__all__ = [
    'DFineCriterion', 'HungarianMatcher', 'PredictionSet', 'dense_one_to_one',
    'dfine_prediction_sets', 'Matched',
    'box_losses', 'ddf_loss', 'fgl_loss', 'mal_loss', 'vfl_loss'
]
