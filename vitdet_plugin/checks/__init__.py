"""Checks that run before the first iteration: the config's pieces against each other and the
dataset (:mod:`.config`), the annotations and images (:mod:`.data`), both together with a
summary line per dataset (:func:`preflight`, and :class:`PreflightCheckHook` for any runner)."""
from .config import ConfigCheckError, check_config, config_problems
from .data import DataCheckError, DataSummary, check_annotations
from .preflight import PreflightCheckHook, drop_preflight_hook, exit_on_report, preflight

__all__ = ['ConfigCheckError', 'check_config', 'config_problems', 'DataCheckError',
           'DataSummary', 'check_annotations', 'PreflightCheckHook', 'drop_preflight_hook',
           'exit_on_report', 'preflight']
