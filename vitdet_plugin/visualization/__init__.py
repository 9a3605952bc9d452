"""Pictures of what a model does (``tools/analysis/visualize.py``, docs/look_inside.md): the
model and its input (:mod:`.model`), what the backbone computes, read with hooks
(:mod:`.capture`), where tokens, windows and shift regions lie (:mod:`.geometry`), the pictures
(:mod:`.figures`, :mod:`.pictures`), the DETR decoder's picture with its own hooks
(:mod:`.decoder`), and a config's padded input and feature pyramid (:mod:`.pyramid`).

Needs matplotlib (a dependency of the package, imported only here)."""


class VisualizeError(ValueError):
    """A bad argument or an unsupported model; the message names the problem and the valid
    choices (the CLI prints it as ``error: <message>``)."""
