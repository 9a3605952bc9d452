"""Where each model part's weights come from: said before training (from the config) and after
the weights are loaded (from the model), and a pretrained URL that cannot be fetched reported
before anything is built.

* :func:`planned_init_lines`: one line per model part from the config alone (the pre-flight
  summary): its ``Pretrained`` checkpoint, or random init, and ``load_from`` over everything.
* :func:`loaded_init_lines`: the same after ``init_weights`` and ``load_from`` ran (the train
  log, :class:`~.preflight.PreflightCheckHook`'s ``before_train``). A module that kept the
  :class:`~vitdet_plugin.weights.LoadReport` of its load as ``init_report`` (with an optional
  ``layout``, ``dropped`` and ``resampled``) gets its tensor count, layout, the checkpoint keys
  it dropped and the tensors resampled to its sizes said too.
* :func:`unreachable_weights`: a ``Pretrained`` URL that is neither in torch hub's cache nor
  reachable: the problem line names the URL, the cache folder, the ``--cfg-options`` that points
  the key at a local copy and ``init_cfg=None`` (random init).
"""
import os.path as osp
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Dict, Iterator, List, Optional, Tuple

#: model keys that are settings, not parts with weights
NOT_PARTS = ('type', 'data_preprocessor', 'train_cfg', 'test_cfg', 'init_cfg', 'pretrained')
#: seconds the URL probe waits for an answer
URL_PROBE_TIMEOUT_S = 10
#: name of the attribute a module may keep its load report in (see the module docstring)
REPORT_ATTR = 'init_report'


def _is_url(path: Any) -> bool:
    return isinstance(path, str) and path.lower().startswith(('http://', 'https://'))


def pretrained_of(init_cfg: Any) -> Optional[Dict[str, Any]]:
    """The ``Pretrained`` entry of an ``init_cfg`` (a dict or a list of them), or None."""
    entries = init_cfg if isinstance(init_cfg, (list, tuple)) else [init_cfg]
    for entry in entries:
        if isinstance(entry, dict) and entry.get('type') == 'Pretrained' \
                and entry.get('checkpoint'):
            return dict(entry)
    return None


def model_parts(model: Dict[str, Any]) -> Iterator[Tuple[str, Dict[str, Any]]]:
    """``(key, config)`` of every part of a model config that holds weights (backbone, neck,
    heads, encoder, ...), in config order."""
    for key, value in model.items():
        if key not in NOT_PARTS and isinstance(value, dict) and 'type' in value:
            yield key, value


def _type_name(cfg: Dict[str, Any]) -> str:
    t = cfg.get('type')
    return t if isinstance(t, str) else getattr(t, '__name__', repr(t))


def _source(pre: Dict[str, Any]) -> str:
    prefix = pre.get('prefix')
    return f'{pre["checkpoint"]}' + (f" (prefix '{prefix}')" if prefix else '')


def planned_init_lines(cfg: Any) -> List[str]:
    """``init <part> (<Type>): ...`` for every part, from the config: what training will load."""
    model = cfg.get('model')
    if not isinstance(model, dict):
        return []
    lines = []
    for key, part in model_parts(model):
        # the detector's own Pretrained init_cfg loads every part (after the parts' inits)
        pre = pretrained_of(model.get('init_cfg')) or pretrained_of(part.get('init_cfg'))
        what = (f'loads {_source(pre)} (init_cfg Pretrained)' if pre else
                'random init (no Pretrained init_cfg)')
        lines.append(f'init {key} ({_type_name(part)}): {what}')
    load_from = cfg.get('load_from')
    if load_from:
        verb = 'resumes from' if cfg.get('resume') else 'then loads'
        lines.append(f'init model: {verb} load_from={load_from} over the parts above')
    return lines


#: how many dropped / resampled names a loaded line shows before it counts the rest
SHOWN_NAMES = 5


def _names(names: List[str]) -> str:
    rest = len(names) - SHOWN_NAMES
    return ', '.join(names[:SHOWN_NAMES]) + (f', ... ({rest} more)' if rest > 0 else '')


def _report_text(module: Any) -> str:
    report = getattr(module, REPORT_ATTR, None)
    loaded = getattr(report, 'loaded', None)
    if loaded is None:
        return ''
    layout = getattr(report, 'layout', None)
    dropped = list(getattr(report, 'dropped', ()))
    resampled = list(getattr(report, 'resampled', ()))
    return (f', {len(loaded)} tensors' + (f', {layout} layout' if layout else '')
            + (f'; dropped {len(dropped)} checkpoint keys: {_names(dropped)}' if dropped else '')
            + (f'; resampled {len(resampled)}: {_names(resampled)}' if resampled else ''))


def loaded_init_lines(model: Any, cfg: Any) -> List[str]:
    """``init <part> (<Class>): loaded from ... | randomly initialised`` for every part of the
    built ``model`` (after ``init_weights`` and ``load_from``), read with the config's
    ``init_cfg`` of each part."""
    model_cfg = cfg.get('model')
    inner = getattr(model, 'module', model)  # DDP / FSDP wrappers keep the model as .module
    if not isinstance(model_cfg, dict):
        return []
    load_from, resume = cfg.get('load_from'), cfg.get('resume')
    lines = []
    for key, part in model_parts(model_cfg):
        module = getattr(inner, key, None)
        if module is None:
            continue
        name = type(module).__name__
        pre = (pretrained_of(model_cfg.get('init_cfg')) or pretrained_of(part.get('init_cfg'))
               or pretrained_of(getattr(module, 'init_cfg', None)))
        if load_from:
            what = f'{"resumed" if resume else "loaded"} from load_from={load_from}'
        elif pre:
            what = f'loaded from {_source(pre)}{_report_text(module)}'
        else:
            what = 'randomly initialised (no Pretrained init_cfg, no load_from)'
        lines.append(f'init {key} ({name}): {what}')
    return lines


def hub_cache_path(url: str) -> str:
    """Where the loaders keep a downloaded ``url``: torch hub's checkpoint folder + its name."""
    import torch
    name = osp.basename(urllib.parse.urlparse(url).path)
    return osp.join(torch.hub.get_dir(), 'checkpoints', name)


def probe_url(url: str, timeout: float = URL_PROBE_TIMEOUT_S) -> Optional[str]:
    """None when ``url`` answers, else why not (``URLError: [Errno 111] Connection refused``)."""
    try:
        request = urllib.request.Request(url, method='HEAD')
        with urllib.request.urlopen(request, timeout=timeout):
            return None
    except urllib.error.HTTPError as e:
        return f'HTTPError: {e.code} {e.reason}'
    except urllib.error.URLError as e:
        return f'URLError: {e.reason}'
    except (OSError, ValueError) as e:  # timeouts, malformed URLs
        return f'{type(e).__name__}: {e}'


def _walk_pretrained(node: Any, path: str) -> Iterator[Tuple[str, str, Dict[str, Any]]]:
    """``(init_cfg key, owner key, Pretrained entry)`` of every Pretrained init_cfg below."""
    if isinstance(node, dict):
        pre = pretrained_of(node.get('init_cfg'))
        if pre is not None:
            yield f'{path}.init_cfg', path, pre
        for key, value in node.items():
            if key != 'init_cfg':
                yield from _walk_pretrained(value, f'{path}.{key}')
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from _walk_pretrained(value, f'{path}.{i}')


def unreachable_weights(cfg: Any) -> List[str]:
    """A problem line for every ``Pretrained`` URL that is not in torch hub's cache and does
    not answer (offline machine, firewall, moved file)."""
    model = cfg.get('model')
    problems = []
    for key, owner, pre in _walk_pretrained(model if isinstance(model, dict) else {}, 'model'):
        url = pre['checkpoint']
        if not _is_url(url) or osp.isfile(hub_cache_path(url)):
            continue
        why = probe_url(url)
        if why is None:
            continue
        cached = hub_cache_path(url)
        problems.append(
            f'{key}.checkpoint={url!r} cannot be downloaded ({why}) and is not in torch hub\'s '
            f'cache ({cached}); download it where there is network and put it at that path, '
            f'or give your copy with --cfg-options {key}.checkpoint=/path/to/'
            f'{osp.basename(cached)}, or train from random init with --cfg-options '
            f'{owner}.init_cfg=None')
    return problems
