"""Pieces of ``tools/analysis/visualize.py``: the model and its input (:mod:`.model`), what
the backbone computes, read with hooks (:mod:`.capture`), where tokens, windows and shift
regions lie (:mod:`.geometry`), the pictures (:mod:`.figures`, :mod:`.pictures`), and the DETR
decoder's picture with its own hooks (:mod:`.decoder`)."""


class VisualizeError(ValueError):
    """A bad argument or an unsupported model; the message names the problem and the valid
    choices (the CLI prints it as ``error: <message>``)."""
